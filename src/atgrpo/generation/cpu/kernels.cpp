// atgrpo's CPU kernels for a float32 decode step, on AVX-512 (atgrpo.generation.cpu.kernels
// builds them, with -ffp-contract=off: a product and a sum written apart are rounded apart, as
// torch's operators round them, and checks their inputs).

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace {

inline __mmask16 tail(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for float32 lanes: 2^n * exp(r), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2], Cephes'
// polynomial for exp(r) (within 2 units in the last place); exactly 0 where x is -inf.
inline __m512 exp512(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}

// silu(g) = g / (1 + exp(-g)), as torch's CPU kernel writes it
inline __m512 silu512(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// A linear layer for the few rows of a decode step.
//
// y[M, N] = x[M, K] @ w[N, K]^T with w packed once into panels of 32 output columns,
// [N / 32][K][32]: a panel is one contiguous stream. The rows go in blocks of up to 14 (28
// accumulators in registers: a block's rows x 2 vectors of 16 columns), as even as they can
// be (32 rows: 11, 11, 10), and k in chunks of kChunk: every block of rows multiplies a chunk
// of the panel while it is in the L1 cache, and each block prefetches its share of the next
// chunk's lines (the panel's, or the next panel's after its last chunk), so that reading the
// weight from memory goes on evenly under all the arithmetic (a decode step reads every weight
// once: at a few rows that read is most of a layer's time). The threads split the panels
// (OpenMP: the process's one runtime, torch's own libgomp). Each output is one float32 fused
// multiply-add chain over k in order (kept in y between chunks, stored and loaded exactly).

namespace {

constexpr int64_t kPanel = 32;  // output columns of a panel: two AVX-512 vectors
constexpr int kMaxRows = 14;    // rows of a block: 28 accumulators + 2 weight vectors
constexpr int64_t kChunk = 64;  // k of a chunk: 8 KB of the panel
constexpr int64_t kLine = 64;   // bytes of a cache line

// One block of Rows rows (x at row stride K) times a chunk of kn k's of a panel, into y (row
// stride ldy), starting from zero or from y; prefetches `lines` cache lines from `ahead`, one
// every few k.
template <int Rows>
void block(const float* x, int64_t K, const float* panel, int64_t kn, float* y, int64_t ldy,
           bool first, const char* ahead, int64_t lines) {
  __m512 acc[Rows][2];
  for (int i = 0; i < Rows; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy + 16);
  }
  const int64_t every = lines > 0 ? std::max<int64_t>(1, kn / lines) : kn + 1;
  int64_t fetched = 0;
  for (int64_t k = 0; k < kn; ++k) {
    if (k % every == 0 && fetched < lines) _mm_prefetch(ahead + kLine * fetched++, _MM_HINT_T0);
    const float* wk = panel + k * kPanel;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    for (int i = 0; i < Rows; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * K + k]);
      acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  while (fetched < lines) _mm_prefetch(ahead + kLine * fetched++, _MM_HINT_T0);
  for (int i = 0; i < Rows; ++i) {
    _mm512_storeu_ps(y + i * ldy, acc[i][0]);
    _mm512_storeu_ps(y + i * ldy + 16, acc[i][1]);
  }
}

using Block = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool,
                       const char*, int64_t);

template <std::size_t... I>
constexpr std::array<Block, sizeof...(I)> blocks(std::index_sequence<I...>) {
  return {block<static_cast<int>(I) + 1>...};
}

// kBlocks[r - 1] multiplies r rows
constexpr auto kBlocks = blocks(std::make_index_sequence<kMaxRows>{});

// y[M, 32] (row stride ldy) = x[M, K] times one panel; `next`: the panel this thread runs
// after this one, whose first chunk the last chunk prefetches.
void panel_product(const float* x, int64_t M, int64_t K, const float* panel, const float* next,
                   float* y, int64_t ldy) {
  const int64_t nblocks = (M + kMaxRows - 1) / kMaxRows, per = (M + nblocks - 1) / nblocks;
  for (int64_t kc = 0; kc < K; kc += kChunk) {
    const int64_t kn = std::min<int64_t>(kChunk, K - kc);
    const bool last = kc + kn == K;  // then the next chunk is the next panel's first
    const float* after = last ? next : panel + (kc + kn) * kPanel;
    const int64_t next_k = last ? kChunk : std::min<int64_t>(kChunk, K - kc - kn);
    const int64_t lines = next_k * kPanel * sizeof(float) / kLine;
    for (int64_t b = 0, r = 0; r < M; ++b, r += per) {
      const int64_t lo = lines * b / nblocks, hi = lines * (b + 1) / nblocks;
      const char* ahead = reinterpret_cast<const char*>(after) + kLine * lo;
      kBlocks[std::min(per, M - r) - 1](x + r * K + kc, K, panel + kc * kPanel, kn, y + r * ldy,
                                        ldy, kc == 0, ahead, hi - lo);
    }
  }
}

}  // namespace

// y [M, N] = x [M, K] @ w^T, w packed as [N / 32][K][32]; all contiguous float32, N % 32 == 0
// (the caller checks). `threads`: the OpenMP threads to split the panels over.
extern "C" void atgrpo_decode_linear(const float* x, const float* packed, float* y, int64_t M,
                                     int64_t K, int64_t N, int threads) {
  const int64_t panels = N / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; ++p) {
    const float* panel = packed + p * K * kPanel;
    panel_product(x, M, K, panel, panel + K * kPanel, y + p * kPanel, N);
  }
}

// A gated MLP's first half: y [M, N] = silu(x @ gate^T) * (x @ up^T), the two weights packed
// together as [gate; up] (2N outputs, [2N / 32][K][32]). Panel p of the gate goes to a scratch
// block, panel p of up to y, and y's columns then become silu(gate) * up: what the linear
// kernel and atgrpo_silu_mul give in three calls, without writing the gate out.
extern "C" void atgrpo_decode_linear_silu_mul(const float* x, const float* packed, float* y,
                                              int64_t M, int64_t K, int64_t N, int threads) {
  const int64_t panels = N / kPanel, size = K * kPanel;
#pragma omp parallel num_threads(threads)
  {
    float* gate = static_cast<float*>(std::malloc(M * kPanel * sizeof(float)));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const float *g = packed + p * size, *u = packed + (panels + p) * size;
      panel_product(x, M, K, g, u, gate, kPanel);
      panel_product(x, M, K, u, g + size, y + p * kPanel, N);
      for (int64_t r = 0; r < M; ++r) {
        float* yr = y + r * N + p * kPanel;
        for (int c = 0; c < kPanel; c += 16) {
          const __m512 s = silu512(_mm512_loadu_ps(gate + r * kPanel + c));
          _mm512_storeu_ps(yr + c, _mm512_mul_ps(s, _mm512_loadu_ps(yr + c)));
        }
      }
    }
    std::free(gate);
  }
}

// ---------------------------------------------------------------------------------------------
// The rotary embedding of transformers' Llama-family attention (apply_rotary_pos_emb with
// rotate_half), in place: each of a row's `heads` heads of `dim` values becomes
// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]), every product and sum
// rounded on its own as torch's operators round them.

// x: rows at row stride `stride`, their first `heads` heads rotated; cos / sin: a row of `dim`
// values for each row (row stride `cs_stride`).
extern "C" void atgrpo_rope(float* x, int64_t rows, int64_t stride, int64_t heads, int64_t dim,
                            const float* cos, const float* sin, int64_t cs_stride) {
  const int64_t half = dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float *c = cos + r * cs_stride, *s = sin + r * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * stride + h * dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail(half - i);
        const __m512 a = _mm512_maskz_loadu_ps(m, v + i), b = _mm512_maskz_loadu_ps(m, v + half + i);
        const __m512 ca = _mm512_maskz_loadu_ps(m, c + i), cb = _mm512_maskz_loadu_ps(m, c + half + i);
        const __m512 sa = _mm512_maskz_loadu_ps(m, s + i), sb = _mm512_maskz_loadu_ps(m, s + half + i);
        const __m512 minus_b = _mm512_sub_ps(_mm512_setzero_ps(), b);
        _mm512_mask_storeu_ps(v + i, m, _mm512_add_ps(_mm512_mul_ps(a, ca), _mm512_mul_ps(minus_b, sa)));
        _mm512_mask_storeu_ps(v + half + i, m, _mm512_add_ps(_mm512_mul_ps(b, cb), _mm512_mul_ps(a, sb)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One decode step's attention over prompts held once (atgrpo.generation.cpu.prefix_cache): row
// n's G query heads of kv head g score against its prompt's keys (held transposed, [d][P16], so a
// block of 16 keys is one multiply-add per dimension) and its own decoded keys, take one masked
// softmax over both, and sum the prompt's and its own values by those weights; one task per
// (row, kv head), the threads splitting the tasks.

namespace {

struct Attention {
  const float* query;       // [N][H][D]
  const float* prompt_kt;   // [prompts][Hkv][D][P16]: the prompt keys transposed, zero-padded
  const float* prompt_v;    // [prompts][Hkv][P][D]
  const float* own_k;       // row n, kv head g, token t at n * own_row + g * own_head + t * D
  const float* own_v;
  const int64_t* members;   // [prompts][width]: each prompt's rows, -1 after its last
  const void* mask;         // [N][P + T] at row stride mask_row: bool (1: attend) or additive
  int mask_kind;            // 0: none, 1: bool, 2: additive float
  int64_t mask_row, own_row, own_head, heads, kv_heads, prompt, prompt16, own, prompts, width;
  float scale;
  float* out;               // [N][H][D]
};

constexpr int kQueries = 8;  // query vectors scored together against each block of 16 keys

// s[i][j] = scale * q[i] . key j for the prompt's keys, 16 at a time (kt: [D][P16])
template <int D>
void prompt_scores(const float* const* q, const float* kt, int64_t P16, float scale,
                   float* const* s) {
  for (int64_t j = 0; j < P16; j += 16) {
    __m512 acc[kQueries];
    for (int i = 0; i < kQueries; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < D; ++c) {
      const __m512 k = _mm512_loadu_ps(kt + c * P16 + j);
      for (int i = 0; i < kQueries; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][c]), k, acc[i]);
    }
    for (int i = 0; i < kQueries; ++i)
      _mm512_storeu_ps(s[i] + j, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
  }
}

// out[i] = sum over the prompt's P value rows of p[i][j] * v[j], for 24 / (D / 16) queries
template <int D>
void prompt_values(const float* const* p, const float* v, int64_t P, float* const* out) {
  constexpr int V = D / 16, Q = 24 / V;
  __m512 acc[Q][V];
  for (int i = 0; i < Q; ++i) for (int c = 0; c < V; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < P; ++j) {
    for (int c = 0; c < V; ++c) {
      const __m512 x = _mm512_loadu_ps(v + j * D + c * 16);
      for (int i = 0; i < Q; ++i) acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][j]), x, acc[i][c]);
    }
  }
  for (int i = 0; i < Q; ++i) for (int c = 0; c < V; ++c) _mm512_storeu_ps(out[i] + c * 16, acc[i][c]);
}

// the row's masked scores -> softmax weights in place, over `length` entries at `s`
void softmax(float* s, int64_t length, int64_t padded) {
  for (int64_t j = length; j < padded; ++j) s[j] = -INFINITY;
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), max));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < padded; j += 16)
    _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
}

// One query vector's part over its row's own decoded tokens, the mask and the softmax: its
// prompt scores are in s[0, P); own scores go to s[P, P + T), then all become weights.
template <int D>
void own_scores_and_softmax(const Attention& a, const float* q, int64_t n, int64_t g, float* s,
                            int64_t stride) {
  const int64_t P = a.prompt, T = a.own, L = P + T;
  const float* own_k = a.own_k + n * a.own_row + g * a.own_head;
  for (int64_t t = 0; t < T; ++t) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(own_k + t * D + c), acc);
    s[P + t] = _mm512_reduce_add_ps(acc) * a.scale;
  }
  if (a.mask_kind == 1) {
    const bool* m = static_cast<const bool*>(a.mask) + n * a.mask_row;
    for (int64_t j = 0; j < L; ++j) if (!m[j]) s[j] = -INFINITY;
  } else if (a.mask_kind == 2) {
    const float* m = static_cast<const float*>(a.mask) + n * a.mask_row;
    for (int64_t j = 0; j < L; ++j) s[j] += m[j];
  }
  softmax(s, L, stride);
}

// out += sum over the row's own T value rows of p[P + t] * v[t]
template <int D>
void own_values(const Attention& a, const float* p, int64_t n, int64_t g, float* out) {
  const float* own_v = a.own_v + n * a.own_row + g * a.own_head;
  __m512 acc[D / 16];
  for (int c = 0; c < D / 16; ++c) acc[c] = _mm512_loadu_ps(out + c * 16);
  for (int64_t t = 0; t < a.own; ++t)
    for (int c = 0; c < D / 16; ++c)
      acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(p[a.prompt + t]), _mm512_loadu_ps(own_v + t * D + c * 16), acc[c]);
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + c * 16, acc[c]);
}

// Runs fn(first, count) over [0, total) in chunks of `chunk`; a short last chunk is padded by
// the caller's spare entries.
template <typename Fn>
void chunks(int64_t total, int chunk, Fn fn) {
  for (int64_t first = 0; first < total; first += chunk) fn(first, std::min<int64_t>(chunk, total - first));
}

// All query heads of kv head g over prompt p's rows (scratch: (width * G + 1) * stride floats
// of scores, the last row a spare that padded chunks write into, and a spare output row).
template <int G, int D>
void attend(const Attention& a, int64_t p, int64_t g, float* scratch, float* spare_out) {
  const int64_t stride = (a.prompt + a.own + 15) / 16 * 16;  // a query's scores; >= P16
  const int64_t* members = a.members + p * a.width;
  int64_t rows = 0;
  while (rows < a.width && members[rows] >= 0) ++rows;
  const int64_t queries = rows * G;
  auto row = [&](int64_t i) { return members[i / G]; };
  auto query = [&](int64_t i) { return a.query + (row(i) * a.heads + g * G + i % G) * D; };
  auto scores = [&](int64_t i) { return scratch + (i < queries ? i : queries) * stride; };
  auto out = [&](int64_t i) { return i < queries ? a.out + (row(i) * a.heads + g * G + i % G) * D : spare_out; };
  const float* kt = a.prompt_kt + (p * a.kv_heads + g) * D * a.prompt16;
  chunks(queries, kQueries, [&](int64_t first, int64_t count) {
    const float* q[kQueries];
    float* s[kQueries];
    for (int i = 0; i < kQueries; ++i) {
      q[i] = query(first + std::min<int64_t>(i, count - 1));
      s[i] = scores(i < count ? first + i : queries);
    }
    prompt_scores<D>(q, kt, a.prompt16, a.scale, s);
  });
  for (int64_t i = 0; i < queries; ++i)
    own_scores_and_softmax<D>(a, query(i), row(i), g, scores(i), stride);
  constexpr int Q = 24 / (D / 16);
  const float* v = a.prompt_v + (p * a.kv_heads + g) * a.prompt * D;
  chunks(queries, Q, [&](int64_t first, int64_t count) {
    const float* w[Q];
    float* o[Q];
    for (int i = 0; i < Q; ++i) {
      w[i] = scores(first + std::min<int64_t>(i, count - 1));
      o[i] = out(i < count ? first + i : queries);
    }
    prompt_values<D>(w, v, a.prompt, o);
  });
  for (int64_t i = 0; i < queries; ++i) own_values<D>(a, scores(i), row(i), g, out(i));
}

template <int G, int D>
void attend_all(const Attention& a, int threads) {
  const int64_t stride = (a.prompt + a.own + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
  {
    float* scratch = static_cast<float*>(std::malloc((a.width * G + 1) * stride * sizeof(float)));
    float spare_out[D];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < a.prompts * a.kv_heads; ++task)
      attend<G, D>(a, task / a.kv_heads, task % a.kv_heads, scratch, spare_out);
    std::free(scratch);
  }
}

}  // namespace

// Returns 0, or 1 where no kernel is compiled for this query-group size and head size.
extern "C" int atgrpo_prefix_attention(const Attention* a, int groups, int dim, int threads) {
#define ATGRPO_CASE(G, D) \
  if (groups == G && dim == D) return attend_all<G, D>(*a, threads), 0;
  ATGRPO_CASE(1, 32) ATGRPO_CASE(2, 32) ATGRPO_CASE(3, 32) ATGRPO_CASE(4, 32)
  ATGRPO_CASE(1, 64) ATGRPO_CASE(2, 64) ATGRPO_CASE(3, 64) ATGRPO_CASE(4, 64)
  ATGRPO_CASE(1, 128) ATGRPO_CASE(2, 128) ATGRPO_CASE(3, 128) ATGRPO_CASE(4, 128)
#undef ATGRPO_CASE
  return 1;
}

// ---------------------------------------------------------------------------------------------
// A decode step's small elementwise layers, each one pass over its few rows instead of a chain
// of torch operators: RMS norm (as transformers' Llama / Qwen norms compute it, in float32) and
// SiLU(gate) * up (a gated MLP's activation).

// y = weight * (x * 1 / sqrt(mean(x^2) + eps)) per row of `dim` values
extern "C" void atgrpo_rms_norm(const float* x, const float* weight, float* y, int64_t rows,
                                int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail(dim - c), xr + c);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
    for (int64_t c = 0; c < dim; c += 16) {
      const __mmask16 m = tail(dim - c);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + c), inv);
      _mm512_mask_storeu_ps(yr + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, weight + c), v));
    }
  }
}

// y = gate * sigmoid(gate) * up, over n values
extern "C" void atgrpo_silu_mul(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail(n - i);
    const __m512 silu = silu512(_mm512_maskz_loadu_ps(m, gate + i));
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

// ---------------------------------------------------------------------------------------------
// The sampler's step over the vocabulary: each row's log-softmax and its exponential (the
// probabilities the token is drawn from) in two passes over the logits instead of torch's
// log_softmax and exp, each a pass of its own.

extern "C" void atgrpo_log_softmax_exp(const float* x, float* logprobs, float* probs, int64_t rows,
                                       int64_t vocab, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * vocab;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < vocab; j += 16)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail(vocab - j), xr + j));
    const float max = _mm512_reduce_max_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < vocab; j += 16) {
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail(vocab - j), xr + j);
      sum = _mm512_add_ps(sum, exp512(_mm512_sub_ps(v, _mm512_set1_ps(max))));
    }
    const __m512 shift = _mm512_set1_ps(max + std::log(_mm512_reduce_add_ps(sum)));
    for (int64_t j = 0; j < vocab; j += 16) {
      const __mmask16 m = tail(vocab - j);
      const __m512 lp = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, xr + j), shift);
      _mm512_mask_storeu_ps(logprobs + r * vocab + j, m, lp);
      _mm512_mask_storeu_ps(probs + r * vocab + j, m, exp512(lp));
    }
  }
}
