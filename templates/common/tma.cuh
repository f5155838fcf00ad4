// Hopper (sm_90) asynchronous-copy and warp-specialisation primitives, as small inline-PTX
// functions: mbarriers (phase-tracked barriers in shared memory whose phase completes when the
// expected arrivals AND the expected transaction bytes have come in), TMA tile loads (the bulk
// tensor copy engine: global -> shared, completing bytes on an mbarrier), setmaxnreg (sm_90a),
// named barriers and elect.sync. Needs types.cuh (u32) and wgmma.cuh (u64). The generic-to-async
// proxy fence (fence.proxy.async.shared::cta, for shared memory written by ordinary stores and
// then read by wgmma or a TMA store) is wgmma.cuh's fence_proxy_async.
// Forms checked against the PTX ISA (mbarrier, cp.async.bulk.tensor, prefetch, setmaxnreg, bar,
// elect) and assembled by ptxas for sm_90a.

// The driver's tensor map (CUtensorMap in cuda.h, which NVRTC does not see here): 128 opaque
// bytes built on the host by cuTensorMapEncodeTiled, passed inside the __grid_constant__
// parameter struct. Aligned as cuda.h (CUDA 13) aligns it, to 128 bytes (the driver asks for
// at least 64); kernels/params.py pads the host struct the same way.
struct alignas(128) CUtensorMap {
  unsigned long long opaque[16];
};
static_assert(sizeof(CUtensorMap) == 128, "a tensor map is 128 bytes");

// Generic address of a tensor map (a kernel parameter): the operand form the TMA takes.
__device__ __forceinline__ u64 tmap_addr(const CUtensorMap& m) { return reinterpret_cast<u64>(&m); }

// Bring a tensor map into the cache the TMA reads descriptors through (once per map per block).
__device__ __forceinline__ void tmap_prefetch(const CUtensorMap& m) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(tmap_addr(m)) : "memory");
}

// --- mbarrier (an 8-byte object in shared memory; `bar` is its shared-space address) ---------

// Set the arrival count of every phase; phase 0 is the current one, with no pending bytes.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Make mbarrier.init visible to the other threads and to the async proxy (the TMA's
// complete_tx) before a barrier publishes the mbarriers; the only form is .release.cluster.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival (release semantics at CTA scope by default: this thread's earlier shared-memory
// reads, wgmma's included once waited for, are ordered before the phase completes).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// One arrival that also adds `bytes` to the transaction count the phase waits for (the
// producer, before the TMA copies that will complete those bytes).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// An arrival on `bar` once every cp.async this thread has issued so far has landed (.noinc: the
// arrival is one of those the barrier was initialised to expect).
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

// True once the phase of parity `parity` has completed (try_wait may suspend the thread for a
// while before it answers false, so the caller's loop does not spin hard). Acquire semantics
// at CTA scope by default: the TMA's writes of the completed phase are visible afterwards.
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

// Wait for the phase of parity `parity` to complete. With kTrapAfter > 0, a wait that lasts
// more than kTrapAfter clock cycles executes trap (the launch fails with an error) instead of
// hanging: for kernels not yet validated, where a wrong byte count or tensor map never
// completes a phase. The clock is read only once the first try has failed.
template <long long kTrapAfter = 0>
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  if constexpr (kTrapAfter > 0) {
    if (mbar_try_wait(bar, parity)) return;
    long long t0, t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0));
    while (!mbar_try_wait(bar, parity)) {
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
      if (t - t0 > kTrapAfter) asm volatile("trap;");
    }
  } else {
    while (!mbar_try_wait(bar, parity)) {
    }
  }
}

// --- TMA ---------------------------------------------------------------------------------

// Load the box at coordinates (c0, c1, c2, c3) (innermost first, in elements) of a 4-D tensor
// map into shared memory at `dst`, completing its bytes on mbarrier `bar`. Out-of-bounds
// elements are filled as the map says (zeros here) and still count as transferred bytes.
// `dst` must be 128-byte aligned, and 1024-byte aligned for the 128-byte swizzle to line up
// with wgmma's (row r's chunk c at c ^ (r & 7)).
__device__ __forceinline__ void tma_load_4d(u32 dst, const CUtensorMap& map, u32 bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5 }], [%6];"
      :: "r"(dst), "l"(tmap_addr(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Copy `bytes` (a multiple of 16; `src` and `dst` 16-byte aligned) from global to shared memory
// with the bulk copy engine (no tensor map), completing them on mbarrier `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Add `bytes` of fp32 (a multiple of 16; both addresses 16-byte aligned) from shared memory into
// global memory element by element (the bulk copy engine's reduction, atomic per element), as
// part of this thread's current bulk group; bulk_commit closes the group, bulk_wait_read waits
// until every committed group has read its shared memory, bulk_wait until they are complete.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// The same copy as a plain store (the first of ordered adds into an accumulator nobody zeroed).
__device__ __forceinline__ void bulk_store_f32(float* dst, u32 src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// A semaphore in global memory: an int counting turns. sem_wait spins until it reads `turn` or
// more (acquire, GPU scope; traps after kTrapAfter cycles as mbar_wait does), then orders this
// thread's later bulk copies (async proxy) after what it saw. sem_release, once this thread's
// bulk writes are complete (bulk_wait), orders them before the release that counts kTurns more turns.
template <long long kTrapAfter = 0>
__device__ __forceinline__ void sem_wait(const int* sem, int turn) {
  long long t0 = 0;
  if constexpr (kTrapAfter > 0) asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0));
  while (true) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
    if (v >= turn) break;
    if constexpr (kTrapAfter > 0) {
      long long t;
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
      if (t - t0 > kTrapAfter) asm volatile("trap;");
    }
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// The semaphore's value now (acquire, GPU scope: this thread's later generic-proxy accesses, and
// what a barrier orders after them, come after what it saw; unlike sem_wait, no bulk copies).
__device__ __forceinline__ int sem_peek(const int* sem) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
  return v;
}
// kAfterBulk: this thread's bulk copies (async proxy) are among what it orders; otherwise only
// generic-proxy writes (release is cumulative: with what a barrier ordered before this thread's
// release, other threads' writes too).
template <int kTurns = 1, bool kAfterBulk = true>
__device__ __forceinline__ void sem_release(int* sem) {
  if constexpr (kAfterBulk) asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(sem), "n"(kTurns) : "memory");
}

// --- warp specialisation -----------------------------------------------------------------

// Per-thread register limit of the calling warpgroup (sm_90a; every warp of the warpgroup runs
// the same one). The kernel needs a register cap at entry (__launch_bounds__(threads, 1)), and
// each role's setmaxnreg must be one branch of a single if/else, or ptxas ignores it (C7508).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "24..256, a multiple of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "24..256, a multiple of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(kRegs));
}

// Named barriers (0 is __syncthreads'): `kThreads` (a multiple of 32) threads take part; sync
// waits for all of them, arrive counts this warp in without waiting.
template <int kId, int kThreads>
__device__ __forceinline__ void named_bar_sync() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0, "ids 1..15, whole warps");
  asm volatile("bar.sync %0, %1;" :: "n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_bar_arrive() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0, "ids 1..15, whole warps");
  asm volatile("bar.arrive %0, %1;" :: "n"(kId), "n"(kThreads) : "memory");
}

// The same with the barrier id a run-time value (warp-uniform).
template <int kThreads>
__device__ __forceinline__ void named_bar_sync_at(int id) {
  static_assert(kThreads % 32 == 0, "whole warps");
  asm volatile("bar.sync %0, %1;" :: "r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_bar_arrive_at(int id) {
  static_assert(kThreads % 32 == 0, "whole warps");
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "n"(kThreads) : "memory");
}

// True in one lane of the (fully active) warp, the same lane every time.
__device__ __forceinline__ bool elect_one() {
  u32 elected;
  asm volatile(
      "{\n.reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}
