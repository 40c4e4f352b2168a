"""A stand-in for Hugging Face `datasets`, on the client's path only (run_bench.py --open-loop): SGLang 0.5.17's
`python -m sglang.bench_serving` imports it at start-up (sglang/benchmark/datasets/mmmu.py) although its sharegpt
loader, the one the testbed uses with a local --dataset-path, never calls it; the GPU image has no `datasets`."""


def load_dataset(*args, **kwargs):
    raise RuntimeError("the testbed has no Hugging Face `datasets`: run sglang.bench_serving with "
                       "--dataset-name sharegpt and a local --dataset-path")
