"""Testbed only (tensor_dump.py puts this folder first on the decode-state server's PYTHONPATH): SGLang 0.5.17's
tensor dump cannot record an EAGLE-3 target. Its `TensorDumper.add_tensor` calls `.cpu()` on every item of a tuple
output, and the target's `LlamaModel` returns `(hidden_states, [aux hidden states])` when the draft's hidden-state
capture is on: "AttributeError: 'list' object has no attribute 'cpu'" at the first forward (2026-12-02, fourth
lease). This flattens nested tuples / lists into one list of tensors (the hidden states first) when the module is
imported; the rest of the dumper is SGLang's. Nothing else in the process changes."""

import importlib.abc
import importlib.util
import sys

_TARGET = "sglang.srt.debug_utils.tensor_dump_forward_hook"


def _flat(items):
    for t in items:
        if isinstance(t, (tuple, list)):
            yield from _flat(t)
        elif t is not None:
            yield t


def _patch(mod):
    orig = mod.TensorDumper.add_tensor

    def add_tensor(self, name, tensor_item):
        if isinstance(tensor_item, (tuple, list)) and any(isinstance(t, (tuple, list)) for t in tensor_item):
            tensor_item = list(_flat(tensor_item))
        return orig(self, name, tensor_item)

    mod.TensorDumper.add_tensor = add_tensor


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module once, then wrap its loader
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
