// Where does the hardware put the CTAs of a cluster launch?  (A question for the producer's
// split policy: select_push's CTAs use 50-59 registers x 512 threads and 20-150 KB of shared
// memory, so two or three fit an SM; if a small grid's CTAs are packed onto fewer SMs, each
// SM does two CTAs' passes and the per-CTA speed halves.)
//   nvcc -arch=sm_90a -O2 -o /tmp/smid_probe tools/smid_probe.cu && /tmp/smid_probe
// Prints, per (grid, cluster, dynamic smem): distinct SMs used and the most CTAs on one SM.
#include <cstdio>
#include <cstdlib>
#include <set>
#include <map>
#include <vector>
#include <cuda_runtime.h>

__global__ void __launch_bounds__(512) probe(int* smid, long long spin) {
  extern __shared__ int dyn[];
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  if (threadIdx.x == 0) smid[blockIdx.x] = (int)s;
  dyn[threadIdx.x] = (int)s;  // touch the shared memory
  long long t0 = clock64();
  while (clock64() - t0 < spin) {
  }  // every CTA resident at once
}

int main() {
  int dev = 0, sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  int* d;
  cudaMalloc(&d, 4096 * sizeof(int));
  printf("SMs %d\n", sms);
  printf("%6s %4s %8s | %8s %10s %s\n", "grid", "C", "smem_KB", "SMs_used", "max_per_SM", "per-cluster SMs (first 4)");
  const int grids[] = {8, 16, 32, 64, 128};
  const int clusters[] = {1, 2, 4, 8};
  const int smems[] = {24, 48, 90, 120};
  for (int g : grids)
    for (int c : clusters)
      for (int sk : smems) {
        if (g % c) continue;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(g);
        cfg.blockDim = dim3(512);
        cfg.dynamicSmemBytes = sk * 1024;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = c;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        std::map<int, int> per;
        std::vector<int> h(g);
        cudaError_t e = cudaLaunchKernelEx(&cfg, probe, d, (long long)200000);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
          printf("%6d %4d %8d | error %s\n", g, c, sk, cudaGetErrorString(e));
          cudaGetLastError();
          continue;
        }
        cudaMemcpy(h.data(), d, g * sizeof(int), cudaMemcpyDeviceToHost);
        int mx = 0;
        for (int i = 0; i < g; ++i) mx = std::max(mx, ++per[h[i]]);
        printf("%6d %4d %8d | %8zu %10d  ", g, c, sk, per.size(), mx);
        for (int k = 0; k < 4 && k * c < g; ++k) {
          std::set<int> u;
          for (int i = 0; i < c; ++i) u.insert(h[k * c + i]);
          printf("%zu ", u.size());
        }
        printf("\n");
      }
  return 0;
}
