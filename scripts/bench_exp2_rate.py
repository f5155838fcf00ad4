"""Results per clock per SM of the exponential unit (ex2.approx in f32, f16x2 and bf16x2; the
bf16x2 form needs sm_90) and of FFMA on this GPU: each thread runs eight independent chains of one
instruction, 2048 threads per SM (blocks of 256 or 1024), one timed launch after a warm-up one.
"instructions" counts per-thread instructions, "results" the values they produce (two for the
packed forms). The rates are taken at the device's boost clock; FFMA stays below its 128 per clock
because the loop's own instructions share the issue slots.

    python scripts/bench_exp2_rate.py
"""
import cupy as cp
import numpy as np

SRC = r'''
#define CHAINS(type, init, asm_text, constraint, fold)                                        \
  type a[8];                                                                                  \
  for (int i = 0; i < 8; ++i) a[i] = init;                                                    \
  for (int it = 0; it < iters; ++it) {                                                        \
    _Pragma("unroll") for (int i = 0; i < 8; ++i) asm volatile(asm_text : constraint(a[i]));   \
  }                                                                                           \
  float s = 0;                                                                                \
  for (int i = 0; i < 8; ++i) s += fold;                                                      \
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;

extern "C" __global__ void ex2_f32(float* out, int iters) {
  CHAINS(float, 0.5f + threadIdx.x * 1e-6f + i * 1e-3f, "ex2.approx.ftz.f32 %0, %0;", "+f", a[i])
}
extern "C" __global__ void ex2_f16x2(float* out, int iters) {
  CHAINS(unsigned, 0x38003800u + i, "ex2.approx.f16x2 %0, %0;", "+r", (float)(a[i] & 0xff))
}
extern "C" __global__ void ex2_bf16x2(float* out, int iters) {
  CHAINS(unsigned, 0x3f003f00u + i, "ex2.approx.ftz.bf16x2 %0, %0;", "+r", (float)(a[i] & 0xff))
}
extern "C" __global__ void ffma(float* out, int iters) {
  CHAINS(float, 0.5f + threadIdx.x * 1e-6f + i * 1e-3f, "fma.rn.ftz.f32 %0, %0, %0, 0f3F000000;", "+f", a[i])
}
'''


def main():
    dev = cp.cuda.Device()
    major, minor = dev.compute_capability
    mod = cp.RawModule(code=SRC, options=(f"-arch=sm_{major}{minor}",))
    sms = dev.attributes["MultiProcessorCount"]
    mhz = dev.attributes["ClockRate"] / 1e3
    iters = 4096
    out = cp.zeros(sms * 2 * 1024, dtype=cp.float32)
    for name, elements in (("ex2_f32", 1), ("ex2_f16x2", 2), ("ex2_bf16x2", 2), ("ffma", 1)):
        kernel = mod.get_function(name)
        for threads in (256, 1024):
            grid = sms * 2 * (1024 // threads)
            args = (out, np.int32(iters))
            kernel((grid,), (threads,), args)  # warm-up
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            kernel((grid,), (threads,), args)
            stop.record()
            stop.synchronize()
            ms = cp.cuda.get_elapsed_time(start, stop)
            per_clock = grid * threads * iters * 8 / (ms * 1e-3) / (mhz * 1e6) / sms
            print(f"{name:10s} {threads:5d} threads/block: {ms:7.3f} ms, {per_clock:6.2f} instructions "
                  f"({per_clock * elements:6.2f} results) per clock per SM at {mhz:.0f} MHz")


if __name__ == "__main__":
    main()
