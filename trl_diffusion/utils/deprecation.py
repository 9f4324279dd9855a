"""Old names of renamed settings, kept working with a `FutureWarning` that names the new one."""

from __future__ import annotations

import functools
import warnings


def _warn(owner: str, old: str, new: str) -> None:
    warnings.warn(
        f"`{owner}.{old}` is renamed `{new}`; the old name will be removed in a future release.",
        FutureWarning,
        stacklevel=3,
    )


def renamed_fields(renames: dict[str, str]):
    """A class decorator (applied above `@dataclass`) that accepts each old name of `renames` (old -> new) as a
    keyword argument and as an attribute, with a `FutureWarning`. The old names are not dataclass fields, so
    parsers built from the fields (`HfArgumentParser`) offer only the new ones."""

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{cls.__name__} got both `{old}` and its new name `{new}`: pass `{new}` only."
                        )
                    _warn(cls.__name__, old, new)
                    kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        for old, new in renames.items():

            def getter(self, old=old, new=new):
                _warn(cls.__name__, old, new)
                return getattr(self, new)

            def setter(self, value, old=old, new=new):
                _warn(cls.__name__, old, new)
                setattr(self, new, value)

            setattr(cls, old, property(getter, setter))
        return cls

    return decorate
