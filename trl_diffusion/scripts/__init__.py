"""One script per job of the `trl-diffusion` command, as TRL's `trl/scripts/`: each has `make_parser()` and `main()`
and runs as `python -m trl_diffusion.scripts.<job>`.

- `train`: every training algorithm (`TRAINING_COMMANDS` of `registry`), SFT included;
- `eval`: the task accuracy of a saved model;
- `registry`: the training subcommands (light: the command line lists them without importing a trainer);
- `utils`: the script arguments and the parser (`DiffusionScriptArguments`, `DiffusionTrlParser`).

The demo keeps its own entry point, `trl_diffusion.demo`.
"""
