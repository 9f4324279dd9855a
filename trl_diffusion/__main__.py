"""`python -m trl_diffusion ...` is the `trl-diffusion` command (the form `--accelerate_config` relaunches with)."""

from .cli import main

raise SystemExit(main())
