# Lab probe: transformer GEMMs timed as calibrate times them (gc + empty_cache before each), then
# back to back after a 3 s heat of 8192^3 GEMMs (as a training step keeps the GPU busy).
import time, torch
from hwprofiles.gpu_sweeps import CudaTimer
dev = torch.device("cuda", 0)
T = CudaTimer(dev)
shapes = [(8192, n, k) for h, f in ((768, 3072), (2048, 8192), (4096, 14336)) for n, k in ((h, h), (3 * h, h), (f, h), (h, f))]
burst = {s: T.gemm(*s, "bf16") for s in shapes}
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
t0 = time.time()
while time.time() - t0 < 3:
    for _ in range(20): a @ b
    torch.cuda.synchronize()
ops = {s: (torch.randn(s[0], s[2], device=dev, dtype=torch.bfloat16), torch.randn(s[2], s[1], device=dev, dtype=torch.bfloat16)) for s in shapes}
hot = {s: T._time(lambda x=x, y=y: x @ y) for s, (x, y) in ops.items()}
for s in shapes:
    f = 2 * s[0] * s[1] * s[2]
    print(s, f"burst {f / burst[s] / 1e12:.0f} TFLOP/s, sustained {f / hot[s] / 1e12:.0f} TFLOP/s, ratio {burst[s] / hot[s]:.3f}")
print(torch.cuda.get_device_name(), "sm clocks now", torch.cuda.clock_rate() if hasattr(torch.cuda, "clock_rate") else "?")
