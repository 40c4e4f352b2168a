"""SGLang patches, one module each; every one is registered through plugin/guard.py by plugin/sglang_hooks.py."""
