"""SGLang external model package of the GPU testbed (SGLANG_EXTERNAL_MODEL_PACKAGE=specctl_testbed_models)."""
