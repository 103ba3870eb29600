// Can a kernel warm its own code in the L2 before it runs it?  (A question for the merge:
// its rescue runs ~25 KB of code once per launch, fetched line by line from HBM after the
// L2 was flushed: ~1 us per KB of code in the fourteenth session's phase profile.)
//   nvcc -arch=sm_90a -O2 -cubin -o /tmp/cpp.cubin tools/code_prefetch_probe.cu   (the bytes to compare)
//   nvcc -arch=sm_90a -O2 -o /tmp/cpp tools/code_prefetch_probe.cu && (/tmp/cpp /tmp/cpp.cubin || /tmp/cpp /tmp/cpp.cubin noread)
// 1. the address PTX gives for the kernel (mov.u64 of its name): are the bytes there, read by
//    ld.global, the kernel's .text in the cubin?
// 2. a kernel of ~100 KB of straight-line code, one CTA, launched after a 256 MB memset: its
//    duration (clock64 in the kernel, and events) with no prefetch, with one warp issuing
//    prefetch.global.L2 over its own code first, and with the prefetch then a spin of S cycles
//    before the code (the lead a rescue's local select would give it).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

// straight-line steps of the long kernel (the preprocessor unrolls: nvcc keeps a loop this long rolled)
#define S(i) x = (x ^ (x >> 7)) * (2u * (i) + 1u) + (unsigned)(i);
#define S4(b) S(b) S(b + 1) S(b + 2) S(b + 3)
#define S16(b) S4(b) S4(b + 4) S4(b + 8) S4(b + 12)
#define S64(b) S16(b) S16(b + 16) S16(b + 32) S16(b + 48)
#define S256(b) S64(b) S64(b + 64) S64(b + 128) S64(b + 192)
#define S1024(b) S256(b) S256(b + 256) S256(b + 512) S256(b + 768)

extern "C" __global__ void __launch_bounds__(512) longcode(unsigned* out, long long* cyc, int mode,
                                                           int code_bytes, long long spin) {
  long long t0 = clock64();
  unsigned long long self;
  asm volatile("mov.u64 %0, longcode;" : "=l"(self));
  if ((mode & 1) && threadIdx.x < 32) {
    for (int o = threadIdx.x * 128; o < code_bytes; o += 32 * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(self + o));
  }
  if (mode & 2) {
    while (clock64() - t0 < spin) {
    }
  }
  __syncthreads();
  long long t1 = clock64();
  unsigned x = threadIdx.x * 2654435761u + (unsigned)mode;
  S1024(0) S1024(1024)
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    cyc[0] = clock64() - t1;  // the long code alone
    cyc[1] = clock64() - t0;  // with the prefetch (and spin)
  }
}

extern "C" __global__ void read_code(unsigned long long* addr, uint4* dst, int n16) {
  unsigned long long a;
  asm volatile("mov.u64 %0, longcode;" : "=l"(a));
  if (threadIdx.x == 0) *addr = a;
  for (int i = threadIdx.x; i < n16; i += blockDim.x) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(a + 16ull * i));
    dst[i] = v;
  }
}

// The cubin's section ".text.<name>": offset and size (ELF64, little endian).
static bool text_section(const std::vector<unsigned char>& f, const char* name, size_t* off, size_t* size) {
  auto u16 = [&](size_t o) { unsigned short v; memcpy(&v, &f[o], 2); return (size_t)v; };
  auto u32 = [&](size_t o) { unsigned v; memcpy(&v, &f[o], 4); return (size_t)v; };
  auto u64 = [&](size_t o) { unsigned long long v; memcpy(&v, &f[o], 8); return (size_t)v; };
  if (f.size() < 64 || memcmp(f.data(), "\x7f" "ELF", 4)) return false;
  size_t shoff = u64(0x28), shent = u16(0x3a), shnum = u16(0x3c), shstr = u16(0x3e);
  size_t stroff = u64(shoff + shstr * shent + 0x18);
  char want[128];
  snprintf(want, sizeof want, ".text.%s", name);
  for (size_t i = 0; i < shnum; i++) {
    size_t h = shoff + i * shent;
    if (!strcmp((const char*)&f[stroff + u32(h)], want)) {
      *off = u64(h + 0x18);
      *size = u64(h + 0x20);
      return true;
    }
  }
  return false;
}

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

int main(int argc, char** argv) {
  std::vector<unsigned char> cub;
  size_t toff = 0, tsize = 0;
  if (argc > 1) {
    FILE* fp = fopen(argv[1], "rb");
    if (fp) {
      fseek(fp, 0, SEEK_END);
      cub.resize(ftell(fp));
      fseek(fp, 0, SEEK_SET);
      if (fread(cub.data(), 1, cub.size(), fp) != cub.size()) cub.clear();
      fclose(fp);
    }
  }
  bool have = text_section(cub, "longcode", &toff, &tsize);
  printf("cubin .text.longcode: %s, %zu bytes\n", have ? "found" : "NOT found", tsize);
  int code_bytes = have ? (int)tsize : 131072;

  // 1. the bytes at the kernel's address (argv[2] "noread": skip it, e.g. after it faulted)
  if (argc <= 2 || strcmp(argv[2], "noread")) {
  const int n16 = 256;
  unsigned long long* d_addr;
  uint4* d_code;
  CK(cudaMalloc(&d_addr, 8));
  CK(cudaMalloc(&d_code, n16 * 16));
  read_code<<<1, 256>>>(d_addr, d_code, n16);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("reading the code at its address: %s (not readable by ld.global)\n", cudaGetErrorString(e));
    return 2;
  }
  unsigned long long addr;
  std::vector<unsigned char> got(n16 * 16);
  CK(cudaMemcpy(&addr, d_addr, 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got.data(), d_code, got.size(), cudaMemcpyDeviceToHost));
  bool same = have && !memcmp(got.data(), &cub[toff], std::min(got.size(), tsize));
  printf("address 0x%llx; first %zu bytes there %s the cubin's .text\n", addr, got.size(),
         same ? "EQUAL" : "DIFFER from");
  if (!same) {
    printf("  read :");
    for (int i = 0; i < 32; i++) printf(" %02x", got[i]);
    printf("\n  cubin:");
    for (int i = 0; have && i < 32; i++) printf(" %02x", cub[toff + i]);
    printf("\n");
  }
  }

  // 2. cold code with and without the prefetch
  unsigned* d_out;
  long long* d_cyc;
  char* flush;
  const size_t flush_bytes = 256u << 20;
  CK(cudaMalloc(&d_out, 512 * 4));
  CK(cudaMalloc(&d_cyc, 16));
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  struct V { const char* name; int mode; long long spin; } vs[] = {
      {"no prefetch", 0, 0}, {"prefetch", 1, 0}, {"prefetch + 4000 cyc", 3, 4000},
      {"prefetch + 16000 cyc", 3, 16000}, {"spin 16000 cyc only", 2, 16000}};
  const int nv = sizeof vs / sizeof vs[0], reps = 41;
  std::vector<std::vector<double>> code_us(nv), all_us(nv), ev_us(nv);
  for (int r = 0; r < reps; r++)
    for (int v = 0; v < nv; v++) {
      CK(cudaMemset(flush, r & 0xff, flush_bytes));  // the L2 cold, code included
      cudaEventRecord(a);
      longcode<<<1, 512>>>(d_out, d_cyc, vs[v].mode, code_bytes, vs[v].spin);
      cudaEventRecord(b);
      CK(cudaEventSynchronize(b));
      long long c[2];
      CK(cudaMemcpy(c, d_cyc, 16, cudaMemcpyDeviceToHost));
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      code_us[v].push_back(c[0] / 1980.0);  // (cycles at the H200's 1.98 GHz)
      all_us[v].push_back(c[1] / 1980.0);
      ev_us[v].push_back(ms * 1e3);
    }
  auto med = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  printf("long kernel: %d bytes of code, one CTA of 512, after a 256 MB memset, median of %d\n", code_bytes, reps);
  printf("%-24s %12s %12s %10s\n", "variant", "code us*", "kernel us*", "events us");
  for (int v = 0; v < nv; v++)
    printf("%-24s %12.2f %12.2f %10.2f\n", vs[v].name, med(code_us[v]), med(all_us[v]), med(ev_us[v]));
  printf("(* clock64 cycles / 1980: us at 1.98 GHz)\n");
  return 0;
}
