"""Every allocation CUDA's reductions make inside one call (`sum` and `mean` over dimensions or
all, fp32, bf16 and fp16, contiguous, transposed and channels-last inputs), from the caching
allocator's history with requested sizes, and the GPU's multiprocessor count and threads per
multiprocessor: the reference kernels/csrc/cuda_reductions.cpp is held to
(kernels/tests/fixtures/reduce_scratch_h200.json, models/tests/cuda_reductions.rs). On a GPU,
PyTorch only:

    python3 scripts/gpu_reduce_probe.py OUT.json
"""
import json, sys, itertools
import torch

dev = torch.device("cuda", 0)
props = torch.cuda.get_device_properties(dev)
cases = []
def add(op, shape, dims, keepdim, dtype, layout="contiguous", out_dtype=None):
    cases.append(dict(op=op, shape=list(shape), dims=dims, keepdim=keepdim, dtype=dtype, layout=layout, out_dtype=out_dtype))
for dt in ["float32", "bfloat16", "float16"]:
    for n, c in itertools.product([8192, 2048, 4096, 16384, 1000, 100, 64], [768, 3072, 1024, 4096, 2048, 5632, 10, 1000, 32000, 7, 256]):
        add("sum", (n, c), [0], False, dt)
    for b, s, c in [(16, 512, 768), (2, 1024, 2048), (2, 1024, 5632), (4, 128, 768), (1, 8192, 4096), (8, 197, 768), (32, 49, 512)]:
        add("sum", (b, s, c), [0, 1], True, dt)
        add("sum", (b, s, c), [0, 1], False, dt)
        add("mean", (b, s, c), [-1], True, dt)
        add("sum", (b, s, c), [-1], False, dt)
        add("sum", (b, s, c), None, False, dt)
        add("mean", (b, s, c), None, False, dt)
    for n, c in [(8192, 768), (2048, 2048), (768, 8192)]:
        add("sum", (n, c), [0], False, dt, layout="transposed")
        add("sum", (n, c), [1], False, dt, layout="transposed")
    for shape in [(32, 64, 56, 56), (32, 256, 14, 14), (8, 3, 224, 224)]:
        add("sum", shape, [0, 2, 3], False, dt)
        add("sum", shape, [0, 2, 3], False, dt, layout="channels_last")
for n, c in [(8192, 768), (2048, 5632)]:
    add("sum", (n, c), [0], False, "bfloat16", out_dtype="float32")

def run(case):
    dt = getattr(torch, case["dtype"])
    shape = case["shape"]
    if case["layout"] == "transposed":
        x = torch.empty(shape[::-1], dtype=dt, device=dev).t()
    elif case["layout"] == "channels_last":
        x = torch.empty(shape, dtype=dt, device=dev).contiguous(memory_format=torch.channels_last)
    else:
        x = torch.empty(shape, dtype=dt, device=dev)
    kw = {}
    if case["out_dtype"]:
        kw["dtype"] = getattr(torch, case["out_dtype"])
    f = getattr(torch, case["op"])
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    if case["dims"] is None:
        y = f(x, **kw)
    else:
        y = f(x, case["dims"], keepdim=case["keepdim"], **kw)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [[e["action"], e["size"]] for e in snap["device_traces"][0]
              if e["action"] in ("alloc", "free_requested", "free_completed")]
    case["events"] = events
    case["out_shape"] = list(y.shape)
    case["out_bytes"] = y.untyped_storage().nbytes()
    del x, y
    torch.cuda.empty_cache()

for c in cases:
    run(c)
doc = {"format": "ckptune.reduce-probe/1", "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
       "multi_processor_count": props.multi_processor_count,
       "max_threads_per_multi_processor": props.max_threads_per_multi_processor, "cases": cases}
json.dump(doc, open(sys.argv[1], "w"))
print(len(cases), "cases", props.multi_processor_count, props.max_threads_per_multi_processor)
