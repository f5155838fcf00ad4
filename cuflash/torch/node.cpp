// cuflash's attention backward as a C++ autograd node (cuflash/torch/node.py builds this file
// with torch.utils.cpp_extension on first use). The forward runs in Python and calls attach(),
// which records this node as the output's grad_fn; the engine then runs the backward here,
// without the Python interpreter: a "program" prepared in Python from cuflash.backward's repeat
// object (the kernels, their parameter structs with the pointer and tensor-map fields left
// blank, grids) is filled in with this call's pointers and launched with cuLaunchKernel. Calls
// the program does not cover (other strides or dtypes, unaligned pointers, create_graph=True)
// call the Python backward instead (``fallback``).
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// Throws std::runtime_error (RuntimeError in Python) with the message's parts unless ``ok``.
// The message is put together with std::string and std::to_string alone: on the PyTorch 2.11
// machine an extension's std::ostringstream crashed the process (TORCH_CHECK's formatted
// messages too), while a std::runtime_error of a std::string was raised as it should be.
inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
std::string text(T n) { return std::to_string(n); }

template <class... Parts>
void check(bool ok, const Parts&... parts) {
  if (ok) return;
  std::string msg;
  ((msg += text(parts)), ...);
  throw std::runtime_error(msg);
}

// Autograd nodes are held by std::shared_ptr up to PyTorch 2.11 and by c10::intrusive_ptr after;
// these two, templates so that only the branch of the PyTorch at hand is compiled, make and
// re-own one either way.
template <class T>
auto new_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) return c10::make_intrusive<T>();
  else return std::make_shared<T>();
}

template <class T>
auto owning(T* n) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) return c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(n);
  else return n->shared_from_this();
}

// The CUDA driver's entry points, looked up in libcuda at first use (no link-time dependency).
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
using EncodeFn = int (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                         const uint32_t*, int, int, int, int);
using CtxGetFn = int (*)(void**);
using CtxSetFn = int (*)(void*);
using DeviceGetFn = int (*)(int*, int);
using PrimaryRetainFn = int (*)(void**, int);
using LaunchExFn = int (*)(const void*, void*, void**, void**);
using IsCapturingFn = int (*)(void*, int*);

struct Driver {
  LaunchFn launch = nullptr;
  EncodeFn encode = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxSetFn ctx_set = nullptr;
  DeviceGetFn device_get = nullptr;
  PrimaryRetainFn primary_retain = nullptr;
  LaunchExFn launch_ex = nullptr;  // (CUDA 12+; without it launches are plain)
  IsCapturingFn is_capturing = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    check(lib, "cuflash: cannot open libcuda.so.1");
    r.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    r.encode = reinterpret_cast<EncodeFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    r.ctx_get = reinterpret_cast<CtxGetFn>(dlsym(lib, "cuCtxGetCurrent"));
    r.ctx_set = reinterpret_cast<CtxSetFn>(dlsym(lib, "cuCtxSetCurrent"));
    r.device_get = reinterpret_cast<DeviceGetFn>(dlsym(lib, "cuDeviceGet"));
    r.primary_retain = reinterpret_cast<PrimaryRetainFn>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    r.launch_ex = reinterpret_cast<LaunchExFn>(dlsym(lib, "cuLaunchKernelEx"));
    r.is_capturing = reinterpret_cast<IsCapturingFn>(dlsym(lib, "cuStreamIsCapturing"));
    check(r.launch && r.encode && r.ctx_get && r.ctx_set && r.device_get && r.primary_retain && r.is_capturing,
          "cuflash: libcuda.so.1 lacks a driver function the node calls");
    return r;
  }();
  return d;
}

// The operands by role, in this order (cuflash.backward's _Ptr and _Map roles; node.py's ROLES):
// the forward's persistent blocks also take a tile counter.
enum Role { kQ, kK, kV, kDout, kOut, kLse, kDq, kDk, kDv, kWs, kCounter, kRoles };

constexpr int kMapBytes = 128;
constexpr int kMaxParams = 1024;  // cuflash.compiler.Kernel's limit on a struct's size

// A field filled in when the launch fires: role's pointer plus ``add`` bytes at ``offset``, or
// (map) the role's TMA tensor map, encoded with the driver's arguments below.
struct Patch {
  int offset = 0;
  int role = 0;
  int64_t add = 0;
  bool map = false;
  int dtype = 0, rank = 0, l2 = 0;
  std::array<uint64_t, 5> dims{};
  std::array<uint64_t, 4> strides{};
  std::array<uint32_t, 5> box{}, elem{};
};

struct Launch {
  void* fn = nullptr;
  std::array<unsigned, 3> grid{}, block{};
  unsigned smem = 0;
  std::string params;  // the struct, with the patched fields blank
  std::vector<Patch> patches;
  unsigned early = 0;  // a launch attribute's id (programmatic stream serialisation), or 0: a plain launch
};

// cuLaunchKernelEx's CUlaunchAttribute (an id, 4 bytes of padding, a 64-byte value) and CUlaunchConfig.
struct alignas(8) LaunchAttr {
  unsigned id;
  unsigned pad;
  int value[16];
};
struct LaunchConfig {
  unsigned dims[7];  // grid x, y, z, block x, y, z, dynamic shared memory
  void* stream;
  LaunchAttr* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(LaunchAttr) == 72 && offsetof(LaunchAttr, value) == 8, "CUlaunchAttribute's layout");
static_assert(sizeof(LaunchConfig) == 56 && offsetof(LaunchConfig, stream) == 32, "CUlaunchConfig's layout");

// One prepared backward: its launches, the fp32 workspace's size, which gradients it allocates
// contiguous (the others like their input), and the strides of (q, k, v, out, lse) it was made for.
struct Program {
  std::vector<Launch> launches;
  int64_t ws_floats = 0;
  std::array<bool, 3> contiguous{};
  std::vector<std::vector<int64_t>> strides;
};

bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// Makes device ``ordinal``'s primary context current on this thread (cuflash's kernels are
// loaded there; the engine's threads may have none, or another device's, current).
void bind_primary_context(const Driver& d, int ordinal) {
  thread_local std::array<void*, 64> primary{};  // retained once per thread and device
  check(ordinal >= 0 && ordinal < (int)primary.size(), "cuflash: device ", ordinal);
  if (!primary[ordinal]) {
    int dev = 0;
    check(d.device_get(&dev, ordinal) == 0 && d.primary_retain(&primary[ordinal], dev) == 0,
          "cuflash: cannot retain device ", ordinal, "'s primary context");
  }
  void* current = nullptr;
  if (d.ctx_get(&current) != 0 || current != primary[ordinal])
    check(d.ctx_set(primary[ordinal]) == 0, "cuflash: cannot make device ", ordinal, "'s context current");
}

// Fills one launch's fields with ``ptrs`` and launches it on ``stream``.
void fire_launch(const Driver& d, const Launch& la, const std::array<uint64_t, kRoles>& ptrs, void* stream) {
  alignas(128) unsigned char buf[kMaxParams];
  std::memcpy(buf, la.params.data(), la.params.size());
  for (const Patch& p : la.patches) {
    if (!p.map) {
      const uint64_t v = ptrs[p.role] + p.add;
      std::memcpy(buf + p.offset, &v, sizeof v);
      continue;
    }
    const int rc = d.encode(buf + p.offset, p.dtype, p.rank, reinterpret_cast<void*>(ptrs[p.role]), p.dims.data(),
                            p.strides.data(), p.box.data(), p.elem.data(), 0 /* no interleave */,
                            3 /* 128-byte swizzle */, p.l2, 0 /* zero fill */);
    check(rc == 0, "cuflash: cuTensorMapEncodeTiled failed with CUresult ", rc);
  }
  void* arg = buf;
  int rc;
  if (la.early && d.launch_ex) {
    LaunchAttr attr{la.early, 0, {1}};  // programmaticStreamSerializationAllowed = 1
    const LaunchConfig config{{la.grid[0], la.grid[1], la.grid[2], la.block[0], la.block[1], la.block[2], la.smem},
                              stream, &attr, 1};
    rc = d.launch_ex(&config, la.fn, &arg, nullptr);
  } else {
    rc = d.launch(la.fn, la.grid[0], la.grid[1], la.grid[2], la.block[0], la.block[1], la.block[2], la.smem, stream,
                  &arg, nullptr);
  }
  check(rc == 0, "cuflash: cuLaunchKernel failed with CUresult ", rc);
}

// Fills the program's fields with ``ptrs`` and launches it on ``stream`` of device ``ordinal``.
void fire(const Program& prog, const std::array<uint64_t, kRoles>& ptrs, void* stream, int ordinal) {
  const Driver& d = driver();
  bind_primary_context(d, ordinal);
  for (const Launch& la : prog.launches) fire_launch(d, la, ptrs, stream);
}

// Whether the interpreter is gone or being finalized: a thread that takes the GIL then is ended
// by Python (pthread_exit), which aborts the process when it unwinds through a destructor.
bool python_ending() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

struct AttentionBackward : public torch::autograd::Node {
  std::shared_ptr<Program> prog;
  py::object fallback;  // fallback(dout, q, k, v, out, lse) -> (dq, dk, dv), the Python backward
  torch::autograd::SavedVariable q_, k_, v_, out_, lse_;

  std::string name() const override { return "CuflashAttentionBackward"; }

  void release_variables() override {
    q_.reset_data(), k_.reset_data(), v_.reset_data(), out_.reset_data(), lse_.reset_data();
  }

  ~AttentionBackward() override {
    if (python_ending()) {  // (at exit: leave the object to the interpreter's teardown)
      fallback.release();
      return;
    }
    py::gil_scoped_acquire gil;
    fallback = py::object();
  }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), out = out_.unpack(owning(this)), lse = lse_.unpack();
    const Program& p = *prog;
    // The program holds for the layouts, dtypes and device it was made for (a saved-tensor hook
    // may give back other ones) and for 16-byte aligned operands (TMA).
    bool usual = !at::GradMode::is_enabled() && dout.strides() == out.strides() && aligned(dout) &&
                 dout.device() == out.device() && lse.scalar_type() == at::kFloat;
    const at::Tensor* saved[5] = {&q, &k, &v, &out, &lse};
    for (int i = 0; usual && i < 5; ++i)
      usual = saved[i]->strides() == c10::IntArrayRef(p.strides[i]) && aligned(*saved[i]) &&
              saved[i]->device() == out.device() && (i == 4 || saved[i]->scalar_type() == dout.scalar_type());
    if (!usual) {
      py::gil_scoped_acquire gil;
      const py::tuple r = fallback(dout, q, k, v, out, lse);
      variable_list g(3);
      for (int i = 0; i < 3; ++i)
        if (!r[i].is_none()) g[i] = r[i].cast<at::Tensor>();
      return g;
    }
    const at::Tensor* ins[3] = {&q, &k, &v};
    at::Tensor g[3];
    for (int i = 0; i < 3; ++i)
      g[i] = p.contiguous[i] ? at::empty_like(*ins[i], at::MemoryFormat::Contiguous) : at::empty_like(*ins[i]);
    const at::Tensor ws = at::empty({p.ws_floats}, q.options().dtype(at::kFloat));
    const std::array<uint64_t, kRoles> ptrs = {
        (uint64_t)q.data_ptr(),    (uint64_t)k.data_ptr(),    (uint64_t)v.data_ptr(),  (uint64_t)dout.data_ptr(),
        (uint64_t)out.data_ptr(),  (uint64_t)lse.data_ptr(),  (uint64_t)g[0].data_ptr(), (uint64_t)g[1].data_ptr(),
        (uint64_t)g[2].data_ptr(), (uint64_t)ws.data_ptr()};
    if (!p.launches.empty()) {  // (a program without launches: the tests' CPU check of the node)
      c10::DeviceGuard guard(q.device());
      const c10::impl::VirtualGuardImpl impl(q.device().type());
      fire(p, ptrs, impl.getStream(q.device()).native_handle(), q.device().index());
    }
    return {g[0], g[1], g[2]};
  }
};

// A launch from Python: (function pointer, grid, block, shared memory, struct bytes, patches[,
// early]), each patch (offset, role, add) or (offset, role, dtype, rank, dims, strides, box,
// element strides, L2 promotion); ``early``: the launch attribute's id (see Launch::early).
Launch parse_launch(const py::handle& h) {
  const py::tuple t = h.cast<py::tuple>();
  Launch la;
  la.fn = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  const auto grid = t[1].cast<std::vector<unsigned>>(), block = t[2].cast<std::vector<unsigned>>();
  check(grid.size() == 3 && block.size() == 3, "cuflash: grid and block are 3-tuples");
  std::copy(grid.begin(), grid.end(), la.grid.begin());
  std::copy(block.begin(), block.end(), la.block.begin());
  la.smem = t[3].cast<unsigned>();
  la.params = t[4].cast<std::string>();
  check(la.params.size() <= kMaxParams, "cuflash: a parameter struct of ", la.params.size(), " bytes");
  for (const py::handle& ph : t[5].cast<py::list>()) {
    const py::tuple pt = ph.cast<py::tuple>();
    Patch p;
    p.offset = pt[0].cast<int>();
    p.role = pt[1].cast<int>();
    check(p.role >= 0 && p.role < kRoles, "cuflash: an unknown role ", p.role);
    if (pt.size() == 3) {
      p.add = pt[2].cast<int64_t>();
      check(p.offset >= 0 && p.offset + 8 <= (int)la.params.size(), "cuflash: a pointer field out of the struct");
    } else {
      p.map = true;
      p.dtype = pt[2].cast<int>(), p.rank = pt[3].cast<int>();
      check(p.rank >= 1 && p.rank <= 5 && p.offset % 64 == 0 && p.offset + kMapBytes <= (int)la.params.size(),
            "cuflash: a tensor map field out of the struct, misaligned or of rank ", p.rank);
      const auto dims = pt[4].cast<std::vector<uint64_t>>(), st = pt[5].cast<std::vector<uint64_t>>();
      const auto box = pt[6].cast<std::vector<uint32_t>>(), elem = pt[7].cast<std::vector<uint32_t>>();
      check((int)dims.size() == p.rank && (int)st.size() == p.rank - 1 && (int)box.size() == p.rank &&
                (int)elem.size() == p.rank, "cuflash: tensor map arguments of the wrong rank");
      std::copy(dims.begin(), dims.end(), p.dims.begin());
      std::copy(st.begin(), st.end(), p.strides.begin());
      std::copy(box.begin(), box.end(), p.box.begin());
      std::copy(elem.begin(), elem.end(), p.elem.begin());
      p.l2 = pt[8].cast<int>();
    }
    la.patches.push_back(p);
  }
  if (t.size() > 6) la.early = t[6].cast<unsigned>();
  return la;
}

// A program from Python: its launches (parse_launch), the workspace's floats, the gradients'
// contiguous flags and the saved tensors' strides.
std::shared_ptr<Program> make_program(const py::list& launches, int64_t ws_floats, std::vector<bool> contiguous,
                                      std::vector<std::vector<int64_t>> strides) {
  auto prog = std::make_shared<Program>();
  check(contiguous.size() == 3 && strides.size() == 5, "cuflash: a program needs 3 flags and 5 strides");
  for (int i = 0; i < 3; ++i) prog->contiguous[i] = contiguous[i];
  prog->strides = std::move(strides);
  prog->ws_floats = ws_floats;
  for (const py::handle& h : launches) prog->launches.push_back(parse_launch(h));
  return prog;
}

// Records the node as ``out``'s grad_fn, with q, k, v's gradient edges; lse stays without one.
void attach(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
            const at::Tensor& lse, std::shared_ptr<Program> prog, py::object fallback) {
  auto node = new_node<AttentionBackward>();
  node->prog = std::move(prog);
  node->fallback = std::move(fallback);
  node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  torch::autograd::set_history(out, node);
  // Saved in the Python Function's order (q, k, v, out, lse): saved-tensor hooks see them in the
  // order they are saved, and a non-reentrant checkpoint's recompute (the Python node or this
  // one) must match them one to one.
  node->q_ = torch::autograd::SavedVariable(q, false);
  node->k_ = torch::autograd::SavedVariable(k, false);
  node->v_ = torch::autograd::SavedVariable(v, false);
  node->out_ = torch::autograd::SavedVariable(out, true);
  node->lse_ = torch::autograd::SavedVariable(lse, false);
}

// ---------------------------------------------------------------------------------------------
// SDPA's flash forward with gradients, whole in C++ (cuflash/torch/sdpa.py calls fast_forward
// first): per layout of (q, k, v) and options, the prepared forward's one launch as a program
// and the backward's program, kept by Python once both exist (fast_keep).

struct FastForward {
  std::array<std::vector<int64_t>, 3> sizes, strides;  // of q, k, v
  at::ScalarType dtype = at::kHalf;
  int device = 0;
  bool causal = false, has_scale = false, deterministic = false;
  double scale = 0;
  std::vector<int64_t> lse_shape;
  Launch launch;
  bool persistent = false;  // takes a zeroed int32 tile counter per stream (role kCounter)
  std::shared_ptr<Program> backward;
  py::object fallback, keep;  // the Python backward; what holds the kernels' modules loaded
};

// Never destroyed (they hold Python objects, which must not be released after the interpreter).
std::vector<std::shared_ptr<FastForward>>& fast_table() {
  static auto* t = new std::vector<std::shared_ptr<FastForward>>();
  return *t;
}
std::vector<std::pair<std::pair<int, uint64_t>, at::Tensor>>& tile_counters() {  // (device, stream) -> counter
  static auto* t = new std::vector<std::pair<std::pair<int, uint64_t>, at::Tensor>>();
  return *t;
}

void fast_keep(const py::handle& launch, bool persistent, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, bool causal, std::optional<double> scale, bool deterministic,
               std::vector<int64_t> lse_shape, std::shared_ptr<Program> backward, py::object fallback,
               py::object keep) {
  auto e = std::make_shared<FastForward>();
  const at::Tensor* in[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    e->sizes[i] = in[i]->sizes().vec();
    e->strides[i] = in[i]->strides().vec();
  }
  e->dtype = q.scalar_type();
  e->device = q.get_device();
  e->causal = causal, e->has_scale = scale.has_value(), e->scale = scale.value_or(0.0);
  e->deterministic = deterministic;
  e->lse_shape = std::move(lse_shape);
  e->launch = parse_launch(launch);
  e->persistent = persistent;
  e->backward = std::move(backward);
  e->fallback = std::move(fallback), e->keep = std::move(keep);
  auto& table = fast_table();
  if (table.size() >= 64) {  // (calls look layouts up one by one: a model has a few)
    for (const auto& old : table) old->keep.attr("fast") = py::none();  // (handed over again on use)
    table.clear();
  }
  table.push_back(std::move(e));
}

void fast_clear() { fast_table().clear(); }

bool holds(const FastForward& e, const at::Tensor* in[3], bool causal, const std::optional<double>& scale,
           bool deterministic) {
  if (e.causal != causal || e.has_scale != scale.has_value() || (e.has_scale && e.scale != *scale) ||
      e.deterministic != deterministic || in[0]->get_device() != e.device)
    return false;
  for (int i = 0; i < 3; ++i)
    if (in[i]->scalar_type() != e.dtype || in[i]->sizes() != c10::IntArrayRef(e.sizes[i]) ||
        in[i]->strides() != c10::IntArrayRef(e.strides[i]) || in[i]->get_device() != e.device)
      return false;
  return true;
}

// (out, lse) of SDPA's flash forward of a layout kept by fast_keep, the output's history
// recorded with the C++ node; None where this call needs the Python path: no gradient wanted,
// tensors that are not plain CUDA tensors (subclasses, fake tensors), another layout or option,
// operands not 16-byte aligned, a stream being captured into a CUDA graph. (sdpa.py checks the
// rest first: dropout, forward-mode AD, torch.func, dispatch modes, compiled autograd.)
py::object fast_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                        std::optional<double> scale) {
  const at::Tensor* in[3] = {&q, &k, &v};
  if (!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad()))
    return py::none();
  for (const at::Tensor* t : in)
    if (!t->is_cuda() || t->key_set().has(c10::DispatchKey::Python) || !t->has_storage() ||
        (reinterpret_cast<uintptr_t>(t->data_ptr()) & 15))
      return py::none();
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  std::shared_ptr<FastForward> found;  // (held: Python that runs below, an allocator's hook, may clear the table)
  for (const auto& e : fast_table())
    if (holds(*e, in, causal, scale, deterministic)) {
      found = e;
      break;
    }
  if (!found) return py::none();
  const FastForward& e = *found;
  c10::DeviceGuard guard(q.device());
  const c10::impl::VirtualGuardImpl impl(q.device().type());
  void* stream = impl.getStream(q.device()).native_handle();
  const Driver& d = driver();
  int capturing = 0;  // (a capture's persistent blocks take no counter: the Python path; as where it cannot tell)
  if (d.is_capturing(stream, &capturing) != 0 || capturing) return py::none();
  std::array<uint64_t, kRoles> ptrs{};
  if (e.persistent) {
    auto& counters = tile_counters();
    const std::pair<int, uint64_t> where{e.device, reinterpret_cast<uint64_t>(stream)};
    const at::Tensor* counter = nullptr;
    for (const auto& c : counters)
      if (c.first == where) counter = &c.second;
    if (!counter) {  // zeroed on this stream; each kernel leaves it zeroed
      counters.emplace_back(where, at::zeros({1}, q.options().dtype(at::kInt)));
      counter = &counters.back().second;
    }
    ptrs[kCounter] = reinterpret_cast<uint64_t>(counter->data_ptr());
  }
  at::Tensor out = at::empty_like(q), lse = at::empty(e.lse_shape, q.options().dtype(at::kFloat));
  ptrs[kQ] = (uint64_t)q.data_ptr(), ptrs[kK] = (uint64_t)k.data_ptr(), ptrs[kV] = (uint64_t)v.data_ptr();
  ptrs[kOut] = (uint64_t)out.data_ptr(), ptrs[kLse] = (uint64_t)lse.data_ptr();
  {
    py::gil_scoped_release nogil;  // (other Python threads run while the driver queues the kernel)
    bind_primary_context(d, e.device);
    fire_launch(d, e.launch, ptrs, stream);
  }
  attach(q, k, v, out, lse, e.backward, e.fallback);
  return py::make_tuple(out, lse);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program, std::shared_ptr<Program>>(m, "Program");
  m.def("make_program", &make_program);
  m.def("attach", &attach);
  m.def("fast_keep", &fast_keep);
  m.def("fast_clear", &fast_clear);
  m.def("fast_forward", &fast_forward);
}
