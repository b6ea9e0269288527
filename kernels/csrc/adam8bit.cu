// 8-bit block-wise Adam/AdamW (Dettmers et al., ICLR 2022): the CUDA twin of the CPU update in
// kernels/src/adam8bit/, compiled at run time by NVRTC (kernels/src/nvrtc.rs).
//
// The Rust side prepends a prelude defining
//   CKPT_QBLOCK                       quantization block length (2048),
//   ckpt_map_m_bits[256]              signed dynamic map for the first moment, as f32 bit patterns,
//   ckpt_map_v_bits[256]              unsigned dynamic map for the second moment,
// so the maps are bit-identical to the CPU path's (no decimal literals to re-parse).
//
// It is compiled with --fmad=false and uses only IEEE-exact operations (+, -, *, /, sqrtf), in
// the same order as the CPU code, so a GPU step is bitwise equal to a CPU step: the test suite
// checks exactly that where a GPU exists.

#define CKPT_THREADS 256
#define CKPT_PER_THREAD (CKPT_QBLOCK / CKPT_THREADS)

// Index of the code nearest to x in a sorted 256-entry map: a branch-free binary search for the
// last entry <= x, then the closer of it and its upper neighbour (ties go to the lower code).
__device__ __forceinline__ unsigned int ckpt_nearest(const float *__restrict__ map, float x) {
    unsigned int lo = 0;
#pragma unroll
    for (unsigned int half = 128; half > 0; half >>= 1) {
        if (map[lo + half] <= x) lo += half;
    }
    if (lo < 255 && (map[lo + 1] - x) < (x - map[lo])) lo += 1;
    return lo;
}

// One element's Adam/AdamW update, operation for operation as `adam_element` in adam8bit/update.rs
// (torch.optim.AdamW's single-tensor formulas). l2 = 0 for AdamW and decay = 1 for Adam leave
// finite g and p unchanged, so one formula serves both (and the CPU evaluates the same one).
struct CkptAdamOut {
    float p, m, v;
};
__device__ __forceinline__ CkptAdamOut ckpt_adam_element(float p, float g, float m, float v, float one_minus_beta1,
                                                         float beta2, float one_minus_beta2, float eps, float l2,
                                                         float decay, float neg_step_size, float bc2_sqrt) {
    const float gi = g + l2 * p;
    const float mn = m + one_minus_beta1 * (gi - m);
    const float vn = beta2 * v + one_minus_beta2 * (gi * gi);
    const float denom = sqrtf(vn) / bc2_sqrt + eps;
    CkptAdamOut out;
    out.p = p * decay + (neg_step_size * mn) / denom;
    out.m = mn;
    out.v = vn;
    return out;
}

// One CUDA block per quantization block. Each thread owns CKPT_PER_THREAD elements at stride
// CKPT_THREADS (coalesced loads). The updated moments stay in registers between the block-wide
// absmax reduction and the re-quantization.
extern "C" __global__ void __launch_bounds__(CKPT_THREADS)
ckpt_adam8bit_blockwise_f32(float *__restrict__ p, const float *__restrict__ g,
                            unsigned char *__restrict__ m_codes, unsigned char *__restrict__ v_codes,
                            float *__restrict__ m_absmax, float *__restrict__ v_absmax, long long n,
                            float one_minus_beta1, float beta2, float one_minus_beta2, float eps, float l2,
                            float decay, float neg_step_size, float bc2_sqrt) {
    __shared__ float map_m[256];
    __shared__ float map_v[256];
    __shared__ float warp_max_m[CKPT_THREADS / 32];
    __shared__ float warp_max_v[CKPT_THREADS / 32];

    const unsigned int t = threadIdx.x;
    // Constant memory serializes divergent reads; the binary search diverges, so use shared.
    map_m[t] = __uint_as_float(ckpt_map_m_bits[t]);
    map_v[t] = __uint_as_float(ckpt_map_v_bits[t]);
    const long long base = (long long)blockIdx.x * CKPT_QBLOCK;
    // Every thread reads the old absmax before the barrier below; thread 0 overwrites it only
    // after the second barrier.
    const float old_am = m_absmax[blockIdx.x];
    const float old_av = v_absmax[blockIdx.x];
    __syncthreads();

    float m[CKPT_PER_THREAD];
    float v[CKPT_PER_THREAD];
    float max_m = 0.0f;
    float max_v = 0.0f;
#pragma unroll
    for (int j = 0; j < CKPT_PER_THREAD; ++j) {
        const long long i = base + (long long)j * CKPT_THREADS + t;
        m[j] = 0.0f;
        v[j] = 0.0f;
        if (i < n) {
            const float mi = map_m[m_codes[i]] * old_am;
            const float vi = map_v[v_codes[i]] * old_av;
            const CkptAdamOut o = ckpt_adam_element(p[i], g[i], mi, vi, one_minus_beta1, beta2, one_minus_beta2, eps,
                                                    l2, decay, neg_step_size, bc2_sqrt);
            p[i] = o.p;
            m[j] = o.m;
            v[j] = o.v;
            max_m = fmaxf(max_m, fabsf(o.m));
            max_v = fmaxf(max_v, fabsf(o.v));
        }
    }

    // Block-wide max: max is exact and order-independent, so this equals the CPU's serial max.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        max_m = fmaxf(max_m, __shfl_xor_sync(0xffffffffu, max_m, off));
        max_v = fmaxf(max_v, __shfl_xor_sync(0xffffffffu, max_v, off));
    }
    if ((t & 31) == 0) {
        warp_max_m[t >> 5] = max_m;
        warp_max_v[t >> 5] = max_v;
    }
    __syncthreads();
    float am = 0.0f;
    float av = 0.0f;
#pragma unroll
    for (int w = 0; w < CKPT_THREADS / 32; ++w) {
        am = fmaxf(am, warp_max_m[w]);
        av = fmaxf(av, warp_max_v[w]);
    }
    if (t == 0) {
        m_absmax[blockIdx.x] = am;
        v_absmax[blockIdx.x] = av;
    }
    // An all-zero block keeps absmax 0 and the zero code (0 * inf would be NaN).
    const float inv_m = am > 0.0f ? 1.0f / am : 0.0f;
    const float inv_v = av > 0.0f ? 1.0f / av : 0.0f;

#pragma unroll
    for (int j = 0; j < CKPT_PER_THREAD; ++j) {
        const long long i = base + (long long)j * CKPT_THREADS + t;
        if (i < n) {
            m_codes[i] = (unsigned char)ckpt_nearest(map_m, m[j] * inv_m);
            v_codes[i] = (unsigned char)ckpt_nearest(map_v, v[j] * inv_v);
        }
    }
}

// 32-bit moments, for tensors below the 8-bit threshold: one thread per element.
extern "C" __global__ void __launch_bounds__(CKPT_THREADS)
ckpt_adam32_f32(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m, float *__restrict__ v,
                long long n, float one_minus_beta1, float beta2, float one_minus_beta2, float eps, float l2,
                float decay, float neg_step_size, float bc2_sqrt) {
    const long long i = (long long)blockIdx.x * CKPT_THREADS + threadIdx.x;
    if (i >= n) return;
    const CkptAdamOut o = ckpt_adam_element(p[i], g[i], m[i], v[i], one_minus_beta1, beta2, one_minus_beta2, eps, l2,
                                            decay, neg_step_size, bc2_sqrt);
    p[i] = o.p;
    m[i] = o.m;
    v[i] = o.v;
}
