// XLA FFI launcher for the two DSA exchange kernels (select_push, merge).
//
// Python (jax_dsa_exchange/_ffi.py) talks to this library in two ways:
//   * plain C functions through ctypes, outside the hot path and outside CUDA
//     graph capture: load a kernel image per device, register an exchange
//     record per (exchange id, device), read the last error;
//   * two XLA FFI handlers (dsa_select_push, dsa_merge) that XLA calls on its
//     own stream; they only look the record up and launch.
//
// libcuda is opened with dlopen at first use: the library must load (and its
// FFI targets register) on a machine without a GPU or driver, where only the
// pure-XLA path runs.

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------
// Driver API, resolved with dlsym.  Versioned names are spelled out (the _v2
// suffixes) because cuda.h's macros only rename the declarations.
// ---------------------------------------------------------------------------
struct Driver {
  CUresult (*Init)(unsigned int);
  CUresult (*GetErrorName)(CUresult, const char**);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*ModuleLoadDataEx)(CUmodule*, const void*, unsigned int, CUjit_option*, void**);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
  // optional (nullptr when the driver lacks it): the producer's count of co-resident clusters
  CUresult (*OccupancyMaxActiveClusters)(int*, CUfunction, const CUlaunchConfig*);
};

std::mutex g_mu;  // guards everything below (loads, registry, driver init)
std::string g_driver_error;
const Driver* g_driver = nullptr;

// Returns the driver table or nullptr (reason in g_driver_error).  Caller holds g_mu.
const Driver* GetDriverLocked() {
  if (g_driver || !g_driver_error.empty()) return g_driver;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    g_driver_error = std::string("cannot dlopen libcuda.so.1 (no NVIDIA driver?): ") + (e ? e : "?");
    return nullptr;
  }
  static Driver d;
  struct Sym {
    void** slot;
    const char* name;
  } syms[] = {
      {(void**)&d.Init, "cuInit"},
      {(void**)&d.GetErrorName, "cuGetErrorName"},
      {(void**)&d.GetErrorString, "cuGetErrorString"},
      {(void**)&d.DeviceGet, "cuDeviceGet"},
      {(void**)&d.DeviceGetAttribute, "cuDeviceGetAttribute"},
      {(void**)&d.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
      {(void**)&d.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"},
      {(void**)&d.CtxPushCurrent, "cuCtxPushCurrent_v2"},
      {(void**)&d.CtxPopCurrent, "cuCtxPopCurrent_v2"},
      {(void**)&d.ModuleLoadDataEx, "cuModuleLoadDataEx"},
      {(void**)&d.ModuleGetFunction, "cuModuleGetFunction"},
      {(void**)&d.FuncSetAttribute, "cuFuncSetAttribute"},
      {(void**)&d.LaunchKernelEx, "cuLaunchKernelEx"},
  };
  for (const Sym& s : syms) {
    *s.slot = dlsym(h, s.name);
    if (!*s.slot) {
      g_driver_error = std::string("libcuda.so.1 lacks ") + s.name + " (driver too old for cuLaunchKernelEx?)";
      return nullptr;
    }
  }
  d.OccupancyMaxActiveClusters = reinterpret_cast<CUresult (*)(int*, CUfunction, const CUlaunchConfig*)>(
      dlsym(h, "cuOccupancyMaxActiveClusters"));
  CUresult rc = d.Init(0);
  if (rc != CUDA_SUCCESS) {
    const char* name = nullptr;
    d.GetErrorName(rc, &name);
    g_driver_error = std::string("cuInit failed: ") + (name ? name : "?");
    return nullptr;
  }
  g_driver = &d;
  return g_driver;
}

// "cuXxx failed: CUDA_ERROR_NAME (description)".
std::string CuError(const Driver* d, const char* call, CUresult rc) {
  const char* name = nullptr;
  const char* desc = nullptr;
  if (d) {
    d->GetErrorName(rc, &name);
    d->GetErrorString(rc, &desc);
  }
  std::string s = std::string(call) + " failed: " + (name ? name : ("CUresult " + std::to_string(rc)).c_str());
  if (desc) s += std::string(" (") + desc + ")";
  return s;
}

// ---------------------------------------------------------------------------
// Layout numbers (jax_dsa_exchange/layout.py is the definition; dsa_layout_constant
// exposes these and a CI test, tests/test_ffi.py, compares them with layout.py).
// ---------------------------------------------------------------------------
constexpr int kStatusOk = 0;
constexpr int kStatusTimeoutRound1 = 1;
constexpr int kStatusTimeoutRescue = 2;
constexpr int kStatusClosed = 3;
constexpr int kStatusCode = 0, kStatusRow = 1, kStatusEpoch = 2, kStatusRank = 3;  // status word indices
constexpr int kStatusReportWords = 4;  // [code, row, epoch, rank]: what a failure reports
// State regions (int32 words): epoch at kStateEpochRows * max_rows, status at
// kStateStatusRows * max_rows.
constexpr int kStateEpochRows = 0, kStateStatusRows = 2;
constexpr int kMaxLocalLen = 1 << 17;
constexpr int kProducerClusterMax = 8;
constexpr int kProducerWideCluster = 4;  // layout.PRODUCER_WIDE_CLUSTER
// The arguments of dsa_load_kernel (the Python side passes this many: an older library would
// ignore the target it no longer checks).
constexpr int kLoadKernelArgs = 11;

// ---------------------------------------------------------------------------
// Kernel parameters, filled by name: the kernel metadata's "params" (kernels/abi.py,
// the one declaration) arrive at load as "name:type,..." and fix the launch order;
// the handlers fill a value per name below and pack them in that order.
// ---------------------------------------------------------------------------
struct ParamSpec {
  const char* name;
  bool i64;  // else i32
};

enum SelectPushParam {
  kSpLogits, kSpRowEnds, kSpRows, kSpCols, kSpEpoch, kSpPeers, kSpRank, kSpMaxRows, kSpCacheTokens, kSpCount
};
constexpr ParamSpec kSelectPushParams[kSpCount] = {
    {"logits", true}, {"row_ends", true}, {"rows", false}, {"cols", false},
    {"epoch", true},  {"peers", true},    {"rank", false}, {"max_rows", false}, {"cache_tokens", false}};

enum MergeParam {
  kMgPeers, kMgLocal, kMgState, kMgLogits, kMgRowEnds, kMgReqId, kMgBlockTable, kMgKvRows, kMgCounts, kMgIds,
  kMgSaturated, kMgRows, kMgCols, kMgBtRows, kMgBtCols, kMgBlockSize, kMgRank, kMgMaxRows, kMgRescueOff,
  kMgFlagsOff, kMgTimeoutUs, kMgHostStatus, kMgCount
};
constexpr ParamSpec kMergeParams[kMgCount] = {
    {"peers", true},       {"local", true},     {"state", true},    {"logits", true},      {"row_ends", true},
    {"req_id", true},      {"block_table", true}, {"kv_rows", true}, {"counts", true},     {"ids", true},
    {"saturated", true},   {"rows", false},     {"cols", false},    {"bt_rows", false},    {"bt_cols", false},
    {"block_size", false}, {"rank", false},     {"max_rows", false}, {"rescue_off", true}, {"flags_off", true},
    {"timeout_us", false}, {"host_status", true}};

constexpr int kMaxParams = kMgCount;

// One parameter value; a kernel parameter points at the member of its type (both at
// offset 0).
union ParamValue {
  int64_t i64;
  int32_t i32;
};

bool ParamTable(const std::string& kernel, const ParamSpec** table, int* n) {
  if (kernel == "select_push") {
    *table = kSelectPushParams;
    *n = kSpCount;
  } else if (kernel == "merge") {
    *table = kMergeParams;
    *n = kMgCount;
  } else {
    return false;
  }
  return true;
}

std::string ParamList(const ParamSpec* table, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += std::string(i ? "," : "") + table[i].name + (table[i].i64 ? ":i64" : ":i32");
  return s;
}

// Parses "name:type,..." into launch-order slots of the launcher's table; the names
// must be exactly the launcher's, each once, with its type.  Returns "" or why not.
std::string ParseParams(const std::string& kernel, const char* spec, int* slots, int* nslots) {
  const ParamSpec* table;
  int n;
  if (!ParamTable(kernel, &table, &n)) return "unknown kernel '" + kernel + "' (select_push or merge)";
  std::string want = ParamList(table, n);
  std::string s = spec ? spec : "";
  std::vector<bool> seen(n, false);
  int count = 0;
  size_t pos = 0;
  while (pos <= s.size() && !s.empty()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(pos, end - pos);
    size_t colon = item.find(':');
    std::string name = item.substr(0, colon), type = colon == std::string::npos ? "" : item.substr(colon + 1);
    int found = -1;
    for (int i = 0; i < n; ++i)
      if (name == table[i].name) found = i;
    if (found < 0 || seen[found] || type != (table[found].i64 ? "i64" : "i32") || count >= n)
      return "kernel params '" + s + "' do not match the launcher's " + kernel + " params '" + want +
             "' (at '" + item + "'): rebuild the kernels or the launcher from one checkout";
    seen[found] = true;
    slots[count++] = found;
    pos = end + 1;
  }
  if (count != n)
    return "kernel params '" + s + "' do not match the launcher's " + kernel + " params '" + want +
           "': rebuild the kernels or the launcher from one checkout";
  *nslots = count;
  return "";
}

// split words: slice_max, cluster_max, min_slice, fill_ctas, cache_max, cache_wide, then
// the count of co-resident clusters of c = 1..kProducerClusterMax CTAs (-1: unknown)
constexpr int kSplitBase = 6;
constexpr int kSplitWords = kSplitBase + kProducerClusterMax;

struct Kernel {
  CUfunction fn = nullptr;
  int block = 0;      // threads per block (x)
  int smem = 0;       // dynamic shared memory bytes
  int source = 0;     // 1 = cubin, 2 = PTX JIT
  std::string kind;   // "select_push" | "merge"
  int nparams = 0;    // launch order: slot[i] indexes the launcher's param table
  int slot[kMaxParams] = {0};
  // select_push's row split (layout.producer_split(), from the kernel metadata):
  // slice_max, cluster_max, min_slice, fill_ctas, cache_max, cache_wide, the cluster fit;
  // cluster_max == 0: no cluster launch.  smem is then the bytes with a cache of cache_max
  // tokens.
  int split[kSplitWords] = {0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1};
  // merge: launched in clusters of this many CTAs, one cluster per row (the metadata's
  // "cluster", kernels/merge.py Merge.clus); 0: no cluster launch
  int cluster = 0;
};

// Rows that run at once, one CTA per SM, in clusters of c: the same rule as
// layout.producer_cluster_fit() (CI-compared): fill_ctas / c, at most the device's count of
// co-resident clusters where it is known (a cluster's CTAs share one GPC: an H200 holds at
// most 120 CTAs in clusters of 4 or 8); unknown: clusters wider than kProducerWideCluster
// only within fill_ctas / 2.
// Rows of clusters of c that run at once at one CTA per SM: fill_ctas / c, at most the
// device's count where known (layout.producer_rows_at_once: the slice-cache rule's test).
long long RowsAtOnce(int c, const int split[kSplitWords]) {
  const long long fill = split[3] < 0 ? 0 : split[3];
  if (c < 1) c = 1;
  const long long f = fill / c;
  const int m = c <= kProducerClusterMax ? split[kSplitBase + c - 1] : -1;
  return m >= 0 && m < f ? m : f;
}

long long ClusterFit(int c, const int split[kSplitWords]) {
  if (c < 1) c = 1;
  const long long fill = split[3] < 0 ? 0 : split[3];
  if (c <= kProducerClusterMax && split[kSplitBase + c - 1] < 0 && c > kProducerWideCluster) return (fill / 2) / c;
  return RowsAtOnce(c, split);
}

// Tokens of a CTA's slice select_push may keep in shared memory (the kernel's
// cache_tokens; its dynamic shared memory is sized for them): the same rule as
// layout.producer_cache_tokens() (CI-compared).  S = the longest slice of this launch;
// kept up to slice_max always, up to cache_wide while two CTAs still fit an SM, up to
// cache_max while the rows run at once at one CTA per SM (RowsAtOnce).
long long SliceTokens(long long length, long long c) { return ((length + c - 1) / c + 7) / 8 * 8; }

int ProducerCacheTokens(int rows, int cols, int c, const int split[kSplitWords]) {
  const int slice_max = split[0], cache_max = split[4], cache_wide = split[5];
  long long length = cols < 1 ? 1 : (cols > kMaxLocalLen ? kMaxLocalLen : cols);
  if (c < 1) c = 1;
  long long s = SliceTokens(length, c);
  if (s <= slice_max) return static_cast<int>(s);
  if (s <= cache_max && (s <= cache_wide || rows <= RowsAtOnce(c, split))) return static_cast<int>(s);
  return slice_max;
}

// CTAs per row of a select_push launch: the same rule as layout.producer_cluster()
// (a CI test compares the two): one per min_slice tokens, at most cluster_max, fewer
// while the rows would not run at once at one CTA per SM (ClusterFit), then more again
// (up to cluster_max) while the slices would be longer than the launch keeps in shared
// memory.
int ProducerCluster(int rows, int cols, const int split[kSplitWords]) {
  const int cluster_max = split[1] > kProducerClusterMax ? kProducerClusterMax : split[1];
  const int min_slice = split[2] < 1 ? 1 : split[2];
  if (cluster_max < 1) return 1;
  long long length = cols < 1 ? 1 : (cols > kMaxLocalLen ? kMaxLocalLen : cols);
  long long c = (length + min_slice - 1) / min_slice;
  if (c > cluster_max) c = cluster_max;
  while (c > 1 && rows > ClusterFit(static_cast<int>(c), split)) --c;
  if (c < 1) c = 1;
  while (c < cluster_max && ProducerCacheTokens(rows, cols, static_cast<int>(c), split) < SliceTokens(length, c)) ++c;
  return static_cast<int>(c);
}

struct Record {
  int rank, world, topk, local_topk, max_rows, timeout_us, merge_grid;
  int64_t peers, local, state, rescue_off, flags_off;
  // Pinned host copy of the state's status words, written by the merge kernel when the
  // status is set (its host_status parameter); read (no sync) when a call starts (0 = none).
  int64_t host_status;
  Kernel select, merge;  // copies: a CUfunction lives as long as the process
  // The configuration's merge_wide image (kernels/cache.py OPTIONAL: rows over wider
  // clusters) and its rows at once; wide_grid 0: none (dsa_set_exchange_wide_merge)
  Kernel merge_wide;
  int wide_grid = 0;
  // The configuration's lean producer image (kernels/lean.py, kernels/cache.py OPTIONAL) and
  // the longest slice it takes (its split's slice_max); 0: none (dsa_set_exchange_lean_producer)
  Kernel select_lean;
  int lean_slice_max = 0;
};

// Whether a select_push launch over [rows, cols] in clusters of c runs the lean image:
// layout.producer_uses_lean (CI-compared): every slice, cut from min(cols, 2**17), fits it.
bool ProducerUsesLean(int cols, int c, int lean_slice_max) {
  long long length = cols < 1 ? 1 : (cols > kMaxLocalLen ? kMaxLocalLen : cols);
  return lean_slice_max > 0 && SliceTokens(length, c < 1 ? 1 : c) <= lean_slice_max;
}

// CTAs per row of a launch that runs the lean image (ProducerUsesLean at select_push's c):
// layout.producer_lean_cluster (CI-compared): c, or one CTA per min_slice tokens of the lean
// image's split (at most its cluster_max) while rows x C stays within its fill_ctas.
int ProducerLeanCluster(int rows, int cols, int c, const int lean_split[kSplitWords]) {
  const long long cluster_max = lean_split[1] > kProducerClusterMax ? kProducerClusterMax : lean_split[1];
  const long long min_slice = lean_split[2] < 1 ? 1 : lean_split[2];
  const long long fill = lean_split[3] < 0 ? 0 : lean_split[3];
  const long long length = cols < 1 ? 1 : (cols > kMaxLocalLen ? kMaxLocalLen : cols);
  long long want = (length + min_slice - 1) / min_slice;
  if (want > cluster_max) want = cluster_max;
  const long long by_fill = fill / (rows < 1 ? 1 : rows);
  if (want > by_fill) want = by_fill;
  return want > c ? static_cast<int>(want) : c;
}

// Whether a merge launch over `rows` runs merge_wide: layout.merge_uses_wide (CI-compared)
bool MergeUsesWide(int rows, int wide_grid) { return wide_grid > 0 && rows > 0 && rows <= wide_grid; }

std::map<std::pair<std::string, int>, Kernel> g_kernels;  // (key, device ordinal)
std::map<std::pair<int64_t, int>, Record> g_records;      // (exchange id, device ordinal)

thread_local std::string t_last_error;

// Successful cuLaunchKernelEx calls made by the handlers.  When XLA records a
// handler into a CUDA graph, the handler runs once at capture and the graph
// replays the kernel without calling it again: comparing this count with the
// kernels' own device-side progress (the epochs) shows whether graphs are used.
std::atomic<int64_t> g_launches{0};

int Fail(std::string msg) {
  t_last_error = std::move(msg);
  return -1;
}

// ---------------------------------------------------------------------------
// FFI helpers.
// ---------------------------------------------------------------------------

// XLA passes ordered-effect tokens as TOKEN-typed (data-less) buffers among the
// operands/results; the handlers skip them, so the same handler serves calls
// with or without tokens.
ffi::Error CollectArgs(const ffi::RemainingArgs& args, ffi::AnyBuffer* out, size_t want,
                       const char* target) {
  size_t n = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument(std::string(target) + ": operand is not a buffer");
    // Tokens only order the calls (op.py), and a rank-0 buffer is no kernel operand
    // (op.py passes none; select_push's s32[] result placeholder is skipped likewise).
    if (b->element_type() == ffi::DataType::TOKEN || b->dimensions().size() == 0) continue;
    if (n == want) return ffi::Error::InvalidArgument(std::string(target) + ": too many operands");
    out[n++] = *b;
  }
  if (n != want)
    return ffi::Error::InvalidArgument(std::string(target) + ": expected " + std::to_string(want) +
                                       " operands, got " + std::to_string(n));
  return ffi::Error::Success();
}

ffi::Error CollectRets(const ffi::RemainingRets& rets, void** out, ffi::AnyBuffer::Dimensions* dims,
                       size_t want, const char* target) {
  size_t n = 0;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument(std::string(target) + ": result is not a buffer");
    if ((*b)->element_type() == ffi::DataType::TOKEN || (*b)->dimensions().size() == 0) continue;
    if (n == want) return ffi::Error::InvalidArgument(std::string(target) + ": too many results");
    if ((*b)->element_type() != ffi::DataType::S32)
      return ffi::Error::InvalidArgument(std::string(target) + ": results must be int32");
    dims[n] = (*b)->dimensions();
    out[n++] = (*b)->untyped_data();
  }
  if (n != want)
    return ffi::Error::InvalidArgument(std::string(target) + ": expected " + std::to_string(want) +
                                       " results, got " + std::to_string(n));
  return ffi::Error::Success();
}

std::string Where(int64_t exchange_id, int device) {
  return " (exchange " + std::to_string(exchange_id) + ", device " + std::to_string(device) + ")";
}

// Copies the record out under the lock: the launch itself needs no lock.
ffi::Error Lookup(int64_t exchange_id, int device, const char* target, Record* rec, const Driver** d) {
  std::lock_guard<std::mutex> lock(g_mu);
  *d = GetDriverLocked();
  if (!*d) return ffi::Error::Internal(std::string(target) + ": " + g_driver_error);
  auto it = g_records.find({exchange_id, device});
  if (it == g_records.end())
    return ffi::Error::InvalidArgument(std::string(target) + ": no exchange registered" +
                                       Where(exchange_id, device) +
                                       "; was it closed, or created for other devices?");
  *rec = it->second;
  return ffi::Error::Success();
}

// The failure a previous call of this exchange left in its status words (layout.py:
// [code, row, epoch, rank]), as an error the jitted call raises in Python; Success
// while healthy.  The copy it reads lags the device by the calls still in flight.
ffi::Error CheckStatus(const Record& rec, const char* target, int64_t exchange_id, int device) {
  if (!rec.host_status) return ffi::Error::Success();
  const volatile int32_t* st = reinterpret_cast<const volatile int32_t*>(rec.host_status);
  int32_t code = st[kStatusCode];
  if (code == kStatusOk) return ffi::Error::Success();
  if (code == kStatusClosed)
    return ffi::Error::Internal(std::string(target) + ": exchange " + std::to_string(exchange_id) +
                                " is closed" + Where(exchange_id, device));
  std::string what = code == kStatusTimeoutRound1   ? "its candidates"
                     : code == kStatusTimeoutRescue ? "its rescue list"
                                                    : "status " + std::to_string(code);
  return ffi::Error::Internal(std::string(target) + ": exchange " + std::to_string(exchange_id) + " rank " +
                              std::to_string(rec.rank) + ": rank " + std::to_string(st[kStatusRank]) +
                              " did not deliver " + what + " for row " + std::to_string(st[kStatusRow]) +
                              " at epoch " + std::to_string(st[kStatusEpoch]) + " within " +
                              std::to_string(rec.timeout_us) +
                              " us; the exchange refuses further calls: recreate it" +
                              Where(exchange_id, device));
}

ffi::Error Launch(const Driver* d, const Kernel& k, unsigned grid, CUstream stream, bool pdl,
                  ParamValue* values, const char* target, int64_t exchange_id, int device, unsigned cluster = 0,
                  int smem = -1) {
  void* params[kMaxParams];
  for (int i = 0; i < k.nparams; ++i) params[i] = &values[k.slot[i]];
  CUlaunchAttribute attrs[2];
  std::memset(attrs, 0, sizeof(attrs));
  unsigned nattrs = 0;
  if (pdl) {
    attrs[nattrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[nattrs++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 0) {  // grid must be a multiple of it
    attrs[nattrs].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[nattrs].value.clusterDim.x = cluster;
    attrs[nattrs].value.clusterDim.y = 1;
    attrs[nattrs++].value.clusterDim.z = 1;
  }
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = grid;
  cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = static_cast<unsigned>(k.block);
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(smem < 0 ? k.smem : smem);
  cfg.hStream = stream;
  cfg.attrs = nattrs ? attrs : nullptr;
  cfg.numAttrs = nattrs;
  CUresult rc = d->LaunchKernelEx(&cfg, k.fn, params, nullptr);
  if (rc != CUDA_SUCCESS)
    return ffi::Error::Internal(std::string(target) + ": " + CuError(d, "cuLaunchKernelEx", rc) +
                                Where(exchange_id, device));
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// dsa_select_push: operands logits bf16[R, L], row_ends s32[R] (+ the ordering
// token); results: the token (it orders the merge) and an s32[] placeholder that
// only makes the result a tuple (op.py); neither is written.
// ---------------------------------------------------------------------------
ffi::Error SelectPushImpl(CUstream stream, int32_t device, int64_t exchange_id, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  const char* target = "dsa_select_push";
  ffi::AnyBuffer in[2] = {ffi::AnyBuffer(nullptr), ffi::AnyBuffer(nullptr)};
  if (auto e = CollectArgs(args, in, 2, target); e.failure()) return e;
  void* no_out[1];
  ffi::AnyBuffer::Dimensions no_dims[1];
  if (auto e = CollectRets(rets, no_out, no_dims, 0, target); e.failure()) return e;
  auto ld = in[0].dimensions();
  if (in[0].element_type() != ffi::DataType::BF16 || ld.size() != 2)
    return ffi::Error::InvalidArgument("dsa_select_push: logits must be bf16[R, L]");
  if (in[1].element_type() != ffi::DataType::S32 || in[1].dimensions().size() != 1 ||
      in[1].dimensions()[0] != ld[0])
    return ffi::Error::InvalidArgument("dsa_select_push: row_ends must be int32[R]");

  Record rec;
  const Driver* d;
  if (auto e = Lookup(exchange_id, device, target, &rec, &d); e.failure()) return e;
  if (auto e = CheckStatus(rec, target, exchange_id, device); e.failure()) return e;
  int32_t rows = static_cast<int32_t>(ld[0]), cols = static_cast<int32_t>(ld[1]);
  if (rows > rec.max_rows)
    return ffi::Error::InvalidArgument("dsa_select_push: R=" + std::to_string(rows) + " > max_rows=" +
                                       std::to_string(rec.max_rows) + Where(exchange_id, device));
  if (rows == 0) return ffi::Error::Success();

  ParamValue v[kSpCount];
  v[kSpLogits].i64 = reinterpret_cast<int64_t>(in[0].untyped_data());
  v[kSpRowEnds].i64 = reinterpret_cast<int64_t>(in[1].untyped_data());
  v[kSpRows].i32 = rows;
  v[kSpCols].i32 = cols;
  v[kSpEpoch].i64 = rec.state;  // the state base: epoch[] is its region kStateEpochRows (= 0)
  v[kSpPeers].i64 = rec.peers;
  v[kSpRank].i32 = rec.rank;
  v[kSpMaxRows].i32 = rec.max_rows;
  // One cluster of C CTAs per row (kernels/select_push.py); no split: one CTA per row.
  unsigned c = rec.select.split[1] > 0 ? static_cast<unsigned>(ProducerCluster(rows, cols, rec.select.split)) : 0;
  // The lean image where every slice fits it (ProducerUsesLean), else select_push; the lean
  // image's rows then cut finer where its split says (ProducerLeanCluster); the slice cache
  // from select_push's split at the launch's C either way.
  const bool lean = ProducerUsesLean(cols, c ? static_cast<int>(c) : 1, rec.lean_slice_max);
  if (lean && c) c = static_cast<unsigned>(ProducerLeanCluster(rows, cols, static_cast<int>(c), rec.select_lean.split));
  const Kernel& k = lean ? rec.select_lean : rec.select;
  // The slice cache and the shared memory for it: the kernel's smem holds cache_max tokens
  // (2 bytes each, last in its layout; the image's own split); a launch gets what its
  // cache_tokens need.
  int cache = 0, smem = k.smem;
  if (rec.select.split[4] > 0) {
    cache = ProducerCacheTokens(rows, cols, c ? static_cast<int>(c) : 1, rec.select.split);
    smem -= 2 * (k.split[4] - cache);
  }
  v[kSpCacheTokens].i32 = cache;
  return Launch(d, k, static_cast<unsigned>(rows) * (c ? c : 1), stream, /*pdl=*/false, v, target, exchange_id,
                device, c, smem);
}

// ---------------------------------------------------------------------------
// dsa_merge: operands logits bf16[R, L], row_ends s32[R], req_id s32[R],
// block_table s32[NR, P] (+ the ordering token of select_push); results kv_rows s32[R, K], counts s32[R],
// then ids s32[R, K] iff with_ids, then saturated s32[R] iff with_saturated.  Launched with programmatic stream serialization (PDL) so it can
// start while select_push (the previous kernel on the stream) still runs.
// ---------------------------------------------------------------------------
ffi::Error MergeImpl(CUstream stream, int32_t device, int64_t exchange_id, int32_t block_size, bool with_ids,
                     bool with_saturated, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const char* target = "dsa_merge";
  ffi::AnyBuffer in[4] = {ffi::AnyBuffer(nullptr), ffi::AnyBuffer(nullptr), ffi::AnyBuffer(nullptr),
                          ffi::AnyBuffer(nullptr)};
  if (auto e = CollectArgs(args, in, 4, target); e.failure()) return e;
  size_t nout = 2 + (with_ids ? 1 : 0) + (with_saturated ? 1 : 0);
  void* out[4] = {nullptr, nullptr, nullptr, nullptr};
  ffi::AnyBuffer::Dimensions dims[4];
  if (auto e = CollectRets(rets, out, dims, nout, target); e.failure()) return e;

  auto ld = in[0].dimensions();
  if (in[0].element_type() != ffi::DataType::BF16 || ld.size() != 2)
    return ffi::Error::InvalidArgument("dsa_merge: logits must be bf16[R, L]");
  int64_t R = ld[0];
  for (int i = 1; i < 3; ++i)
    if (in[i].element_type() != ffi::DataType::S32 || in[i].dimensions().size() != 1 || in[i].dimensions()[0] != R)
      return ffi::Error::InvalidArgument("dsa_merge: row_ends and req_id must be int32[R]");
  auto bt = in[3].dimensions();
  if (in[3].element_type() != ffi::DataType::S32 || bt.size() != 2)
    return ffi::Error::InvalidArgument("dsa_merge: block_table must be int32[num_requests, max_pages]");
  if (block_size < 1) return ffi::Error::InvalidArgument("dsa_merge: block_size must be >= 1");

  Record rec;
  const Driver* d;
  if (auto e = Lookup(exchange_id, device, target, &rec, &d); e.failure()) return e;
  if (auto e = CheckStatus(rec, target, exchange_id, device); e.failure()) return e;
  if (R > rec.max_rows)
    return ffi::Error::InvalidArgument("dsa_merge: R=" + std::to_string(R) + " > max_rows=" +
                                       std::to_string(rec.max_rows) + Where(exchange_id, device));
  if (dims[0].size() != 2 || dims[0][0] != R || dims[0][1] != rec.topk || dims[1].size() != 1 || dims[1][0] != R)
    return ffi::Error::InvalidArgument("dsa_merge: kv_rows must be int32[R, topk=" + std::to_string(rec.topk) +
                                       "] and counts int32[R]" + Where(exchange_id, device));
  if (R == 0) return ffi::Error::Success();

  int32_t rows = static_cast<int32_t>(R);
  ParamValue v[kMgCount];
  v[kMgPeers].i64 = rec.peers;
  v[kMgLocal].i64 = rec.local;
  v[kMgState].i64 = rec.state;
  v[kMgLogits].i64 = reinterpret_cast<int64_t>(in[0].untyped_data());
  v[kMgRowEnds].i64 = reinterpret_cast<int64_t>(in[1].untyped_data());
  v[kMgReqId].i64 = reinterpret_cast<int64_t>(in[2].untyped_data());
  v[kMgBlockTable].i64 = reinterpret_cast<int64_t>(in[3].untyped_data());
  v[kMgKvRows].i64 = reinterpret_cast<int64_t>(out[0]);
  v[kMgCounts].i64 = reinterpret_cast<int64_t>(out[1]);
  size_t next = 2;
  v[kMgIds].i64 = with_ids ? reinterpret_cast<int64_t>(out[next++]) : 0;
  v[kMgSaturated].i64 = with_saturated ? reinterpret_cast<int64_t>(out[next++]) : 0;
  v[kMgRows].i32 = rows;
  v[kMgCols].i32 = static_cast<int32_t>(ld[1]);
  v[kMgBtRows].i32 = static_cast<int32_t>(bt[0]);
  v[kMgBtCols].i32 = static_cast<int32_t>(bt[1]);
  v[kMgBlockSize].i32 = block_size;
  v[kMgRank].i32 = rec.rank;
  v[kMgMaxRows].i32 = rec.max_rows;
  v[kMgRescueOff].i64 = rec.rescue_off;
  v[kMgFlagsOff].i64 = rec.flags_off;
  v[kMgTimeoutUs].i32 = rec.timeout_us;
  // The kernel itself fills the pinned copy when the status is set (no copy node after
  // every merge: in a CUDA graph it cost ~8 us of stream time per call, H200).
  v[kMgHostStatus].i64 = rec.host_status;
  // merge_grid: rows at once (CTAs, or with a clustered merge its clusters of c CTAs); the
  // wide image instead when every row has its own cluster of it (then grid = rows)
  const bool wide = MergeUsesWide(rows, rec.wide_grid);
  const Kernel& mk = wide ? rec.merge_wide : rec.merge;
  const int mgrid = wide ? rec.wide_grid : rec.merge_grid;
  unsigned grid = static_cast<unsigned>(rows < mgrid ? rows : mgrid);
  const unsigned c = mk.cluster > 1 ? static_cast<unsigned>(mk.cluster) : 1u;
  if (auto e = Launch(d, mk, grid * c, stream, /*pdl=*/true, v, target, exchange_id, device, c > 1 ? c : 0);
      e.failure())
    return e;
  return ffi::Error::Success();
}

}  // namespace

// Both handlers only enqueue work on XLA's stream, with arguments fixed per
// (exchange, buffer addresses), so XLA may record them into CUDA graphs
// (command buffers) and replay them without calling the handler again.  The
// *NoGraph variants are the same handlers without that trait, for when a
// handler must run on every call (see docs/ffi.md: exchange lifetime).
#define DSA_SELECT_PUSH_BINDING                    \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<CUstream>>()        \
      .Ctx<ffi::DeviceOrdinal>()                   \
      .Attr<int64_t>("exchange_id")                \
      .RemainingArgs()                             \
      .RemainingRets()
#define DSA_MERGE_BINDING                          \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::PlatformStream<CUstream>>()        \
      .Ctx<ffi::DeviceOrdinal>()                   \
      .Attr<int64_t>("exchange_id")                \
      .Attr<int32_t>("block_size")                 \
      .Attr<bool>("with_ids")                      \
      .Attr<bool>("with_saturated")                \
      .RemainingArgs()                             \
      .RemainingRets()

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsaSelectPush, SelectPushImpl, DSA_SELECT_PUSH_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsaMerge, MergeImpl, DSA_MERGE_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsaSelectPushNoGraph, SelectPushImpl, DSA_SELECT_PUSH_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsaMergeNoGraph, MergeImpl, DSA_MERGE_BINDING);

// ---------------------------------------------------------------------------
// C API for ctypes.  Returns >= 0 on success, -1 on error (dsa_last_error()).
// ---------------------------------------------------------------------------
extern "C" {

const char* dsa_last_error() { return t_last_error.c_str(); }

// 1 when libcuda could be opened and initialised, else 0 (reason in dsa_last_error()).
int dsa_driver_available() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (GetDriverLocked()) return 1;
  t_last_error = g_driver_error;
  return 0;
}

// The parameters ("name:type,...", launch order of kernels/abi.py) the launcher
// fills for `kernel` ("select_push" | "merge"); "" for another name.
const char* dsa_launcher_params(const char* kernel) {
  static const std::string sp = ParamList(kSelectPushParams, kSpCount), mg = ParamList(kMergeParams, kMgCount);
  std::string k = kernel ? kernel : "";
  return k == "select_push" ? sp.c_str() : k == "merge" ? mg.c_str() : "";
}

// A layout number of this launcher by its layout.py name (layout.launcher_constants());
// -1 for an unknown name.
int64_t dsa_layout_constant(const char* name) {
  static const std::pair<const char*, int64_t> table[] = {
      {"STATUS_OK", kStatusOk}, {"STATUS_TIMEOUT_ROUND1", kStatusTimeoutRound1},
      {"STATUS_TIMEOUT_RESCUE", kStatusTimeoutRescue}, {"STATUS_CLOSED", kStatusClosed},
      {"STATUS_CODE", kStatusCode}, {"STATUS_ROW", kStatusRow}, {"STATUS_EPOCH", kStatusEpoch},
      {"STATUS_RANK", kStatusRank}, {"STATUS_REPORT_WORDS", kStatusReportWords},
      {"STATE_EPOCH_ROWS", kStateEpochRows}, {"STATE_STATUS_ROWS", kStateStatusRows},
      {"MAX_LOCAL_LEN", kMaxLocalLen}, {"PRODUCER_CLUSTER_MAX", kProducerClusterMax},
      {"LOAD_KERNEL_ARGS", kLoadKernelArgs},
      {"PRODUCER_WIDE_CLUSTER", kProducerWideCluster}};
  for (const auto& e : table)
    if (name && std::strcmp(name, e.first) == 0) return e.second;
  return -1;
}

// The arch-specific target ("sm_90a", "sm_100a", ...) of `device`'s compute capability, or ""
// with `*err` set.  Kernels built for one such target run on that compute capability only: its
// PTX cannot be JIT-compiled for another one.  Caller holds g_mu.
std::string DeviceArchLocked(const Driver* d, int device, std::string* err) {
  CUdevice dev;
  int major = 0, minor = 0;
  CUresult rc = d->DeviceGet(&dev, device);
  if (rc == CUDA_SUCCESS) rc = d->DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  if (rc == CUDA_SUCCESS) rc = d->DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  if (rc != CUDA_SUCCESS) {
    *err = CuError(d, "cuDeviceGetAttribute(COMPUTE_CAPABILITY)", rc);
    return "";
  }
  return "sm_" + std::to_string(major) + std::to_string(minor) + "a";
}

// Loads `entry` from a cubin (preferred) or PTX (JIT fallback) into the primary
// context of `device`, once per (key, device).  `kernel` ("select_push" | "merge")
// and `params` (the metadata's "name:type,..." in launch order) say how the
// handlers pack its parameters; other names than the launcher's are refused.
// `arch` (the metadata's, e.g. "sm_90a"; empty: not checked) must be the device's own target.
// Returns 1 if the cubin was used, 2 if the PTX was, -1 on error.
int dsa_load_kernel(const char* key, const char* kernel, const char* params, const void* cubin,
                    int64_t cubin_size, const char* ptx, const char* entry, int device, int block, int smem,
                    const char* arch) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string where = std::string("kernel '") + key + "' on device " + std::to_string(device);
  int slots[kMaxParams];
  int nslots = 0;
  std::string kind = kernel ? kernel : "";
  if (std::string why = ParseParams(kind, params, slots, &nslots); !why.empty()) return Fail(where + ": " + why);
  auto found = g_kernels.find({key, device});
  if (found != g_kernels.end()) {
    if (found->second.block != block || found->second.smem != smem || found->second.kind != kind ||
        found->second.nparams != nslots || !std::equal(slots, slots + nslots, found->second.slot))
      return Fail(where + " is already loaded with other launch parameters");
    return found->second.source;
  }
  if (block < 1 || block > 1024 || smem < 0) return Fail(where + ": bad block/smem " + std::to_string(block) + "/" + std::to_string(smem));
  if ((!cubin || cubin_size <= 0) && (!ptx || !*ptx)) return Fail(where + ": neither cubin nor PTX given");
  const Driver* d = GetDriverLocked();
  if (!d) return Fail(where + ": " + g_driver_error);
  if (arch && *arch) {
    std::string why;
    std::string have = DeviceArchLocked(d, device, &why);
    if (have.empty()) return Fail(where + ": " + why);
    if (have != arch)
      return Fail(where + " was built for " + arch + ", but the device is " + have +
                  ": build the kernels for it with python -m jax_dsa_exchange.build --arch " + have);
  }

  CUdevice dev;
  CUcontext ctx;
  CUresult rc = d->DeviceGet(&dev, device);
  if (rc != CUDA_SUCCESS) return Fail(where + ": " + CuError(d, "cuDeviceGet", rc));
  // The primary context is the one XLA (and CuPy) use; it is retained for the
  // life of the process, since the loaded module must outlive every launch.
  rc = d->DevicePrimaryCtxRetain(&ctx, dev);
  if (rc != CUDA_SUCCESS) return Fail(where + ": " + CuError(d, "cuDevicePrimaryCtxRetain", rc));
  rc = d->CtxPushCurrent(ctx);
  if (rc != CUDA_SUCCESS) return Fail(where + ": " + CuError(d, "cuCtxPushCurrent", rc));

  Kernel k;
  k.block = block;
  k.smem = smem;
  k.kind = kind;
  k.nparams = nslots;
  std::copy(slots, slots + nslots, k.slot);
  std::string err;
  CUmodule mod = nullptr;
  std::string cubin_err = "no cubin given";
  if (cubin && cubin_size > 0) {
    rc = d->ModuleLoadDataEx(&mod, cubin, 0, nullptr, nullptr);
    if (rc == CUDA_SUCCESS) k.source = 1;
    else cubin_err = CuError(d, "cuModuleLoadDataEx(cubin)", rc);
  }
  if (!k.source && ptx && *ptx) {
    // The driver refused the cubin (e.g. another architecture): JIT the PTX,
    // keeping the JIT log for the error message.
    char log[4096] = {0};
    CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* vals[] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(log)))};
    rc = d->ModuleLoadDataEx(&mod, ptx, 2, opts, vals);
    if (rc == CUDA_SUCCESS) k.source = 2;
    else err = cubin_err + "; " + CuError(d, "cuModuleLoadDataEx(PTX)", rc) + (log[0] ? std::string(": ") + log : "");
  } else if (!k.source) {
    err = cubin_err + "; no PTX fallback given";
  }
  if (k.source) {
    rc = d->ModuleGetFunction(&k.fn, mod, entry);
    if (rc != CUDA_SUCCESS) err = CuError(d, (std::string("cuModuleGetFunction('") + entry + "')").c_str(), rc);
  }
  if (err.empty() && smem > 48 * 1024) {
    // Above 48 KB a kernel must opt in to its dynamic shared memory.
    rc = d->FuncSetAttribute(k.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
    if (rc != CUDA_SUCCESS) err = CuError(d, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", rc);
  }
  CUcontext popped;
  d->CtxPopCurrent(&popped);
  if (!err.empty()) return Fail(where + ": " + err);
  g_kernels[{key, device}] = k;
  return k.source;
}

// Clusters of c = 1..cluster_max CTAs of `k` that `device` runs at once at the kernel's full
// dynamic shared memory (one CTA per SM for select_push's builds: their smem holds a 64K-token
// cache), by cuOccupancyMaxActiveClusters; -1 where unknown (no driver entry, an error).
// Caller holds g_mu.
static void MeasureClusterFit(const Driver* d, int device, const Kernel& k, int cluster_max, int* fit) {
  for (int c = 1; c <= kProducerClusterMax; ++c) fit[c - 1] = -1;
  if (!d || !d->OccupancyMaxActiveClusters || !k.fn) return;
  CUdevice dev;
  CUcontext ctx, popped;
  if (d->DeviceGet(&dev, device) != CUDA_SUCCESS || d->DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS) return;
  if (d->CtxPushCurrent(ctx) != CUDA_SUCCESS) {
    d->DevicePrimaryCtxRelease(dev);
    return;
  }
  for (int c = 1; c <= cluster_max && c <= kProducerClusterMax; ++c) {
    CUlaunchAttribute attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = static_cast<unsigned>(c);
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    CUlaunchConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.gridDimX = static_cast<unsigned>(c);
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = static_cast<unsigned>(k.block);
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.sharedMemBytes = static_cast<unsigned>(k.smem);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = -1;
    if (d->OccupancyMaxActiveClusters(&n, k.fn, &cfg) == CUDA_SUCCESS && n >= 0) fit[c - 1] = n;
  }
  d->CtxPopCurrent(&popped);
  d->DevicePrimaryCtxRelease(dev);  // (the kernel's load keeps its own retain)
}

// Sets the row split of a loaded select_push kernel (before dsa_register_exchange,
// which copies the kernel).  All zero: no cluster launch.  With clusters (cluster_max > 1)
// the launcher also counts the device's co-resident clusters (MeasureClusterFit).
int dsa_set_kernel_split(const char* key, int device, int slice_max, int cluster_max, int min_slice,
                         int fill_ctas, int cache_max, int cache_wide) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto found = g_kernels.find({key, device});
  std::string where = std::string("kernel '") + key + "' on device " + std::to_string(device);
  if (found == g_kernels.end()) return Fail(where + " is not loaded");
  if (slice_max < 0 || cluster_max < 0 || cluster_max > kProducerClusterMax || min_slice < 0 || fill_ctas < 0 ||
      cache_max < 0 || cache_wide < 0 || (cache_max > 0 && (cache_max < slice_max || 2 * cache_max > found->second.smem)))
    return Fail(where + ": bad split " + std::to_string(slice_max) + "/" + std::to_string(cluster_max) + "/" +
                std::to_string(cache_max) + " for smem " + std::to_string(found->second.smem));
  int v[kSplitWords] = {slice_max, cluster_max, min_slice, fill_ctas, cache_max, cache_wide};
  MeasureClusterFit(cluster_max > 1 ? GetDriverLocked() : nullptr, device, found->second, cluster_max,
                    v + kSplitBase);
  std::memcpy(found->second.split, v, sizeof(v));
  return 0;
}

// A loaded merge kernel built for clusters of `cluster` CTAs per row (its metadata's
// "cluster"; 1: none): every launch then uses them.  *fit = the clusters of that size the
// device runs at once (what sizes merge_grid so the W grids stay co-resident), -1 unknown.
int dsa_set_kernel_cluster(const char* key, int device, int cluster, int* fit) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto found = g_kernels.find({key, device});
  std::string where = std::string("kernel '") + key + "' on device " + std::to_string(device);
  if (found == g_kernels.end()) return Fail(where + " is not loaded");
  if (cluster < 1 || cluster > kProducerClusterMax)
    return Fail(where + ": cluster " + std::to_string(cluster) + " not in [1, " +
                std::to_string(kProducerClusterMax) + "]");
  found->second.cluster = cluster > 1 ? cluster : 0;
  int f[kProducerClusterMax];
  MeasureClusterFit(cluster > 1 ? GetDriverLocked() : nullptr, device, found->second, cluster, f);
  *fit = cluster > 1 ? f[cluster - 1] : -1;
  return 0;
}

// The co-resident cluster counts the launcher measured for a loaded select_push kernel
// (layout.producer_cluster_fit's ``cluster_fit``): kProducerClusterMax ints into `out`.
int dsa_kernel_cluster_fit(const char* key, int device, int* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto found = g_kernels.find({key, device});
  if (found == g_kernels.end())
    return Fail(std::string("kernel '") + key + "' on device " + std::to_string(device) + " is not loaded");
  std::memcpy(out, found->second.split + kSplitBase, sizeof(int) * kProducerClusterMax);
  return 0;
}

static void SplitOf(int slice_max, int cluster_max, int min_slice, int fill_ctas, int cache_max, int cache_wide,
             const int* fit, int* v) {
  const int base[kSplitBase] = {slice_max, cluster_max, min_slice, fill_ctas, cache_max, cache_wide};
  std::memcpy(v, base, sizeof(base));
  for (int c = 0; c < kProducerClusterMax; ++c) v[kSplitBase + c] = fit ? fit[c] : -1;
}

// The launcher's cluster size for [rows, cols] under a split and a cluster fit
// (kProducerClusterMax ints, or null: unknown) (for the CI test that compares it with
// layout.producer_cluster).
int dsa_producer_cluster(int rows, int cols, int slice_max, int cluster_max, int min_slice, int fill_ctas,
                         int cache_max, int cache_wide, const int* fit) {
  int v[kSplitWords];
  SplitOf(slice_max, cluster_max, min_slice, fill_ctas, cache_max, cache_wide, fit, v);
  return ProducerCluster(rows, cols, v);
}

// The launcher's cache_tokens for [rows, cols] at cluster size c (CI: equal to
// layout.producer_cache_tokens).
int dsa_producer_cache_tokens(int rows, int cols, int c, int slice_max, int cluster_max, int min_slice,
                              int fill_ctas, int cache_max, int cache_wide, const int* fit) {
  int v[kSplitWords];
  SplitOf(slice_max, cluster_max, min_slice, fill_ctas, cache_max, cache_wide, fit, v);
  return ProducerCacheTokens(rows, cols, c, v);
}

int dsa_register_exchange(int64_t exchange_id, int device, int rank, int world, int topk, int local_topk,
                          int max_rows, int64_t peers, int64_t local, int64_t state, int64_t rescue_off,
                          int64_t flags_off, int timeout_us, int merge_grid, const char* select_key,
                          const char* merge_key, int64_t host_status) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string where = Where(exchange_id, device);
  if (g_records.count({exchange_id, device})) return Fail("exchange already registered" + where);
  if (world < 1 || rank < 0 || rank >= world)
    return Fail("rank " + std::to_string(rank) + " not in [0, world=" + std::to_string(world) + ")" + where);
  if (topk < 1 || local_topk < 1 || max_rows < 1 || merge_grid < 1 || timeout_us < 0)
    return Fail("topk, local_topk, max_rows and merge_grid must be positive" + where);
  if (!peers || !local || !state) return Fail("peers, local and state must be device addresses" + where);
  auto ks = g_kernels.find({select_key, device});
  if (ks == g_kernels.end())
    return Fail(std::string("kernel '") + select_key + "' not loaded on device " + std::to_string(device) + where);
  auto km = g_kernels.find({merge_key, device});
  if (km == g_kernels.end())
    return Fail(std::string("kernel '") + merge_key + "' not loaded on device " + std::to_string(device) + where);
  if (ks->second.kind != "select_push" || km->second.kind != "merge")
    return Fail(std::string("kernel '") + select_key + "' must be a select_push and '" + merge_key + "' a merge" +
                where);
  Record r;
  r.rank = rank;
  r.world = world;
  r.topk = topk;
  r.local_topk = local_topk;
  r.max_rows = max_rows;
  r.timeout_us = timeout_us;
  r.merge_grid = merge_grid;
  r.peers = peers;
  r.local = local;
  r.state = state;
  r.rescue_off = rescue_off;
  r.flags_off = flags_off;
  r.host_status = host_status;
  r.select = ks->second;
  r.merge = km->second;
  g_records[{exchange_id, device}] = r;
  return 0;
}

// The registered exchange's merge_wide image (a loaded merge kernel, its clusters set with
// dsa_set_kernel_cluster and wider than the merge's) and the clusters of it each launch may
// hold at once (>= 1); launches of rows <= wide_grid then run it (MergeUsesWide).
// (With g_mu held.)  The registered record of (exchange_id, device) and the loaded kernel `key`
// of kind `kind` on that device for a second image of it; -1 (Fail) where either is missing.
static int FindSecondImage(int64_t exchange_id, int device, const char* key, const char* kind,
                           const std::string& where, std::map<std::pair<int64_t, int>, Record>::iterator* r,
                           std::map<std::pair<std::string, int>, Kernel>::iterator* k) {
  *r = g_records.find({exchange_id, device});
  if (*r == g_records.end()) return Fail("no exchange registered" + where);
  *k = g_kernels.find({key, device});
  if (*k == g_kernels.end())
    return Fail(std::string("kernel '") + key + "' not loaded on device " + std::to_string(device) + where);
  if ((*k)->second.kind != kind) return Fail(std::string("kernel '") + key + "' must be a " + kind + where);
  return 0;
}

int dsa_set_exchange_wide_merge(int64_t exchange_id, int device, const char* key, int wide_grid) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string where = Where(exchange_id, device);
  std::map<std::pair<int64_t, int>, Record>::iterator r;
  std::map<std::pair<std::string, int>, Kernel>::iterator k;
  if (FindSecondImage(exchange_id, device, key, "merge", where, &r, &k) < 0) return -1;
  if (k->second.cluster <= r->second.merge.cluster)
    return Fail(std::string("kernel '") + key + "': clusters of " + std::to_string(k->second.cluster) +
                " CTAs, not wider than the merge's " + std::to_string(r->second.merge.cluster) + where);
  if (wide_grid < 1) return Fail("wide_grid " + std::to_string(wide_grid) + " must be >= 1" + where);
  r->second.merge_wide = k->second;
  r->second.wide_grid = wide_grid;
  return 0;
}

// The launcher's choice of image (for the CI test that compares it with layout.merge_uses_wide).
int dsa_merge_uses_wide(int rows, int wide_grid) { return MergeUsesWide(rows, wide_grid) ? 1 : 0; }

// The registered exchange's lean producer image (a loaded select_push kernel, its split set:
// its slice_max is the longest slice it takes, its cache_max what its shared memory holds);
// launches whose slices all fit it then run it (ProducerUsesLean).
int dsa_set_exchange_lean_producer(int64_t exchange_id, int device, const char* key) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string where = Where(exchange_id, device);
  std::map<std::pair<int64_t, int>, Record>::iterator r;
  std::map<std::pair<std::string, int>, Kernel>::iterator k;
  if (FindSecondImage(exchange_id, device, key, "select_push", where, &r, &k) < 0) return -1;
  const int slice_max = k->second.split[0], cache_max = k->second.split[4];
  if (slice_max < 1 || cache_max < slice_max || (r->second.select.split[4] > 0 && slice_max > r->second.select.split[0]))
    return Fail(std::string("kernel '") + key + "': split slice_max " + std::to_string(slice_max) + ", cache_max " +
                std::to_string(cache_max) + " (set it first; at most select_push's slice_max " +
                std::to_string(r->second.select.split[0]) + ", whose launches keep such slices)" + where);
  r->second.select_lean = k->second;
  r->second.lean_slice_max = slice_max;
  return 0;
}

// The launcher's choice of producer image (for the CI test that compares it with
// layout.producer_uses_lean).
int dsa_producer_uses_lean(int cols, int c, int lean_slice_max) {
  return ProducerUsesLean(cols, c, lean_slice_max) ? 1 : 0;
}

// The launcher's cluster size for a launch on the lean image (for the CI test that compares it
// with layout.producer_lean_cluster): the lean split's cluster_max, min_slice, fill_ctas.
int dsa_producer_lean_cluster(int rows, int cols, int c, int cluster_max, int min_slice, int fill_ctas) {
  int v[kSplitWords];
  SplitOf(0, cluster_max, min_slice, fill_ctas, 0, 0, nullptr, v);
  return ProducerLeanCluster(rows, cols, c, v);
}

int dsa_unregister_exchange(int64_t exchange_id, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_records.erase({exchange_id, device})) return Fail("no exchange registered" + Where(exchange_id, device));
  return 0;
}

// Number of registered (exchange, device) records (for tests and leak checks).
int dsa_num_exchanges() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int>(g_records.size());
}

// XLA FFI API version of the headers this library was built with, as
// major * 1000 + minor.  XLA refuses handlers of a newer minor version than its
// own (silently, at registration), so Python compares this with the running
// jaxlib's headers and explains instead.
int dsa_ffi_api_version() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }

// Kernel launches made by the FFI handlers so far (diagnostic, see g_launches).
int64_t dsa_launch_count() { return g_launches.load(std::memory_order_relaxed); }

}  // extern "C"
