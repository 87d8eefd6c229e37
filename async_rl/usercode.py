"""User code a config names (`module:attr` for envs, rewards): imported the way a command line
user expects, the working directory first, and every way it can fail one ConfigError."""
import importlib
import os
import sys

from async_rl.config import ConfigError


def load_callable(what: str, spec: str):
    """The callable a `module:attr.path` config value names (`what` is the `key=value` the error
    names); each way it can be wrong is one ConfigError. The module is looked for in the working
    directory first, as `python -m` does (the `async-rl` script alone would not look there)."""
    mod_name, _, attr = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        fn = importlib.import_module(mod_name)
    except ImportError as e:
        where = ""
        if isinstance(e, ModuleNotFoundError) and e.name and mod_name.startswith(e.name):
            where = (f"; looked in the working directory ({here}) and the Python path: run from the folder "
                     f"holding {e.name.split('.')[0]}.py or add its folder to PYTHONPATH")
        raise ConfigError(f"{what}: cannot import module {mod_name!r} ({' '.join(str(e).split())}){where}") from None
    except Exception as e:  # the module's own code failed as it was imported
        raise ConfigError(f"{what}: importing module {mod_name!r} raised {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}") from None
    for part in attr.split("."):
        if (fn := getattr(fn, part, None)) is None:
            raise ConfigError(f"{what}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{what}: {attr!r} in {mod_name!r} is not callable")
    return fn
