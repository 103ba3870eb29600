// Stand-in kernels with the exact launch ABI of the CuTe DSL select_push and
// merge kernels (all params plain 64-bit addresses / 32-bit ints, same order).
// They exercise the FFI plumbing on a GPU, not the protocol:
//   fake_select_push: per row, counts the positive logits among the first
//     row_ends[r] columns and stores (count, epoch[r] + 1) into its own
//     symmetric buffer, reached through the peers table; then lets the merge
//     start early (PDL).
//   fake_merge: waits for select_push (griddepcontrol.wait), reads the pair,
//     writes kv_rows through the block table, counts, ids (if given),
//     saturated = the call's epoch (if given), then bumps state.epoch[r].
//     It stores its scalar params in state[max_rows:] so a test can check them,
//     and uses dynamic shared memory (> 48 KB when launched so).
// Build: nvcc -cubin -arch=sm_90a fake_kernels.cu ; nvcc -ptx -arch=sm_90a ...
#include <cstdint>

#define FAKE_TOPK 64

extern "C" __global__ void fake_select_push(int64_t logits, int64_t row_ends, int rows, int cols, int64_t epoch,
                                            int64_t peers, int rank, int max_rows, int cache_tokens) {
  int r = blockIdx.x;
  const int64_t* table = reinterpret_cast<const int64_t*>(peers);
  int* buf = reinterpret_cast<int*>(table[rank]);
  if (threadIdx.x == 0 && r < rows) {
    int e = reinterpret_cast<const int*>(epoch)[r] + 1;
    int n = min(max(reinterpret_cast<const int*>(row_ends)[r], 0), cols);
    const unsigned short* lg = reinterpret_cast<const unsigned short*>(logits) + (size_t)r * cols;
    int pos = 0;
    for (int j = 0; j < n; ++j) pos += ((lg[j] & 0x8000) == 0) && ((lg[j] & 0x7fff) != 0) && ((lg[j] & 0x7fff) <= 0x7f80);
    buf[2 * r] = pos;
    buf[2 * r + 1] = e;
  }
  asm volatile("griddepcontrol.launch_dependents;");
}

extern "C" __global__ void fake_merge(int64_t peers, int64_t local, int64_t state, int64_t logits, int64_t row_ends,
                                      int64_t req_id, int64_t block_table, int64_t kv_rows, int64_t counts,
                                      int64_t ids, int64_t saturated, int rows, int cols, int bt_rows, int bt_cols,
                                      int block_size, int rank, int max_rows, int64_t rescue_off, int64_t flags_off,
                                      int timeout_us, int64_t host_status) {
  extern __shared__ int smem[];
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int* buf = reinterpret_cast<const int*>(local);
  int* st = reinterpret_cast<int*>(state);
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    if (threadIdx.x == 0) {
      smem[0] = buf[2 * r];
      smem[1] = buf[2 * r + 1];
    }
    __syncthreads();
    int pos = min(smem[0], FAKE_TOPK), e = smem[1];
    int q = reinterpret_cast<const int*>(req_id)[r];
    const int* bt = reinterpret_cast<const int*>(block_table) + (size_t)q * bt_cols;
    for (int j = threadIdx.x; j < FAKE_TOPK; j += blockDim.x) {
      reinterpret_cast<int*>(kv_rows)[(size_t)r * FAKE_TOPK + j] =
          j < pos ? bt[(j / block_size) % bt_cols] * block_size + j % block_size : -1;
      if (ids) reinterpret_cast<int*>(ids)[(size_t)r * FAKE_TOPK + j] = j < pos ? j * 16 + rank : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      reinterpret_cast<int*>(counts)[r] = pos;
      if (saturated) reinterpret_cast<int*>(saturated)[r] = e;
      st[r] = e;  // the next call's epoch is e + 1
    }
    __syncthreads();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int* p = st + max_rows;
    p[0] = rows; p[1] = cols; p[2] = bt_rows; p[3] = bt_cols; p[4] = block_size;
    p[5] = (int)rescue_off; p[6] = (int)flags_off; p[7] = timeout_us;
  }
}
