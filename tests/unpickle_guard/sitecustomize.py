"""Loaded by every Python process started with this folder first on PYTHONPATH (tests/test_fsdp.py),
and kept by the processes it forks (the launcher's ranks):
records in the file ``$FSDP_TEST_UNPICKLE_LOG`` each time the process unpickles a file
(``torch.load``, ``pickle.load``, a ``pickle.Unpickler`` of a file), with the stack. Unpickling
from memory (``io.BytesIO``: what ``all_gather_object`` does between ranks) is not recorded,
except inside ``torch.load``, which is recorded whatever it reads."""

import importlib.abc
import importlib.util
import os
import pickle
import sys
import traceback

_LOG = os.environ["FSDP_TEST_UNPICKLE_LOG"]


def _note(what: str) -> None:
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {what}\n" + "".join(traceback.format_stack()))


def _guarded() -> None:
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(f"guarded {os.getpid()}\n")


_guarded()
os.register_at_fork(after_in_child=_guarded)  # a forked process (a rank) keeps the guard

_load, _Unpickler = pickle.load, pickle.Unpickler


def _guarded_load(file, *args, **kwargs):
    _note(f"pickle.load {getattr(file, 'name', file)!r}")
    return _load(file, *args, **kwargs)


class _GuardedUnpickler(_Unpickler):
    def __init__(self, file, *args, **kwargs):
        if hasattr(file, "name"):  # a file, not bytes in memory (io.BytesIO has no name)
            _note(f"pickle.Unpickler {getattr(file, 'name', file)!r}")
        super().__init__(file, *args, **kwargs)


pickle.load, pickle.Unpickler = _guarded_load, _GuardedUnpickler


class _GuardTorchLoad(importlib.abc.MetaPathFinder):
    """Wraps ``torch.serialization.load`` as soon as it is defined, before ``torch`` binds it as
    ``torch.load``."""

    def find_spec(self, name, path, target=None):
        if name != "torch.serialization":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.load

            def guarded(f, *args, **kwargs):
                _note(f"torch.load {f!r}")
                return real(f, *args, **kwargs)

            module.load = guarded

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _GuardTorchLoad())
