// Checks the CUDA kernels behind gpu_launchers.h on a real GPU, with no
// TensorFlow: each launcher is called on device buffers and its output is
// compared, bit for bit, with a host reference computed here.
//
// Why without TensorFlow: the kernels are pure CUDA behind raw-pointer
// launchers (see ops/cc/kernels/gpu_launchers.h), so they can be run and
// checked (under compute-sanitizer too) on any machine with a GPU and nvcc,
// including one where no CUDA build of TensorFlow is installed.
//
// Data are small integers, so every sum is exact in every dtype and the
// order of the atomic adds cannot change a bit of the result.
//
// Usage: launchers_check [--large] [--bench]
//   --large  adds cases that cross the kernels' grid-stride limits (~2 GB)
//   --bench  prints gather / scatter-add / pack / unpack bandwidth against
//            a device-to-device cudaMemcpy of the same bytes
// Exit status: 0 all passed, 1 a check failed, 77 no CUDA device.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../../ops/cc/kernels/gpu_launchers.h"

namespace {

using geeps_gpu::DType;

int g_passed = 0;
int g_failed = 0;

void Check(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAIL %s\n", what.c_str());
  }
}

void Cuda(int err, const char* what) {
  if (err != 0) {
    std::printf("CUDA error in %s: %s\n", what, geeps_gpu::ErrorString(err));
    std::exit(1);
  }
}

const char* Name(DType d) {
  switch (d) {
    case geeps_gpu::kFloat32: return "float32";
    case geeps_gpu::kFloat16: return "float16";
    case geeps_gpu::kBFloat16: return "bfloat16";
    case geeps_gpu::kFloat64: return "float64";
  }
  return "?";
}

// Host buffers of one dtype, filled from doubles holding small integers.
std::vector<uint8_t> Encode(DType d, const std::vector<double>& values) {
  const int64_t size = geeps_gpu::DTypeSize(d);
  std::vector<uint8_t> out(values.size() * size);
  for (size_t i = 0; i < values.size(); ++i) {
    uint8_t* p = out.data() + i * size;
    const double v = values[i];
    if (d == geeps_gpu::kFloat32) {
      const float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
    } else if (d == geeps_gpu::kFloat64) {
      std::memcpy(p, &v, 8);
    } else if (d == geeps_gpu::kFloat16) {
      const __half h = __float2half_rn(static_cast<float>(v));
      std::memcpy(p, &h, 2);
    } else {
      const __nv_bfloat16 b = __float2bfloat16_rn(static_cast<float>(v));
      std::memcpy(p, &b, 2);
    }
  }
  return out;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    Cuda(cudaMalloc(&ptr, n == 0 ? 1 : n), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  uint8_t* bytes_ptr() const { return static_cast<uint8_t*>(ptr); }
  void Upload(const void* src, size_t n, size_t at = 0) {
    if (n) Cuda(cudaMemcpy(bytes_ptr() + at, src, n, cudaMemcpyHostToDevice),
                "upload");
  }
  std::vector<uint8_t> Download(size_t n, size_t at = 0) const {
    std::vector<uint8_t> out(n);
    if (n) Cuda(cudaMemcpy(out.data(), bytes_ptr() + at, n,
                           cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

std::vector<uint8_t> IndexBytes(const std::vector<int64_t>& idx, bool index64) {
  std::vector<uint8_t> out(idx.size() * (index64 ? 8 : 4));
  for (size_t i = 0; i < idx.size(); ++i) {
    if (index64) {
      std::memcpy(out.data() + 8 * i, &idx[i], 8);
    } else {
      const int32_t v = static_cast<int32_t>(idx[i]);
      std::memcpy(out.data() + 4 * i, &v, 4);
    }
  }
  return out;
}

std::vector<double> SmallInts(size_t n, std::mt19937_64& rng, int lo = -8,
                              int hi = 8) {
  std::uniform_int_distribution<int> dist(lo, hi);
  std::vector<double> out(n);
  for (auto& v : out) v = dist(rng);
  return out;
}

const DType kDTypes[] = {geeps_gpu::kFloat32, geeps_gpu::kFloat16,
                         geeps_gpu::kBFloat16, geeps_gpu::kFloat64};

// GatherRows against out[i] = params[idx[i]], `misalign` elements into both
// buffers so each copy unit (16, 8, 4, 2 bytes) gets used.
void CheckGather(DType d, bool index64, int64_t rows, int64_t width, int64_t n,
                 int64_t misalign, std::mt19937_64& rng) {
  const int64_t es = geeps_gpu::DTypeSize(d);
  const auto params = Encode(d, SmallInts(rows * width, rng));
  std::uniform_int_distribution<int64_t> pick(0, rows - 1);
  std::vector<int64_t> idx(n);
  for (auto& v : idx) v = pick(rng);
  const auto idx_bytes = IndexBytes(idx, index64);
  const size_t row_bytes = width * es;
  const size_t at = misalign * es;
  DeviceBuffer dparams(at + params.size()), didx(idx_bytes.size()),
      dout(at + n * row_bytes);
  dparams.Upload(params.data(), params.size(), at);
  didx.Upload(idx_bytes.data(), idx_bytes.size());
  Cuda(cudaMemset(dout.ptr, 0x5a, dout.bytes), "memset");
  Cuda(geeps_gpu::GatherRows(nullptr, d, dparams.bytes_ptr() + at, rows, width,
                             didx.ptr, index64, n, dout.bytes_ptr() + at),
       "GatherRows");
  Cuda(cudaDeviceSynchronize(), "GatherRows sync");
  const auto got = dout.Download(n * row_bytes, at);
  bool ok = true;
  for (int64_t i = 0; i < n && ok; ++i) {
    ok = std::memcmp(got.data() + i * row_bytes,
                     params.data() + idx[i] * row_bytes, row_bytes) == 0;
  }
  char what[160];
  std::snprintf(what, sizeof(what),
                "gather %s idx%d rows=%lld width=%lld n=%lld misalign=%lld",
                Name(d), index64 ? 64 : 32, (long long)rows, (long long)width,
                (long long)n, (long long)misalign);
  Check(ok, what);
}

// ScatterAddRows with duplicate indices, against a host sum.
void CheckScatterAdd(DType d, bool index64, int64_t rows, int64_t width,
                     int64_t n, int64_t misalign, std::mt19937_64& rng) {
  const int64_t es = geeps_gpu::DTypeSize(d);
  auto base = SmallInts(rows * width, rng);
  const auto updates = SmallInts(n * width, rng, -2, 2);
  // Few distinct rows, so many adds land on the same element.
  std::uniform_int_distribution<int64_t> pick(0, std::min<int64_t>(rows, 7) - 1);
  std::vector<int64_t> idx(n);
  for (auto& v : idx) v = pick(rng);
  const auto idx_bytes = IndexBytes(idx, index64);
  const size_t at = misalign * es;
  DeviceBuffer dparams(at + rows * width * es), didx(idx_bytes.size()),
      dupd(at + n * width * es);
  const auto base_bytes = Encode(d, base);
  const auto upd_bytes = Encode(d, updates);
  dparams.Upload(base_bytes.data(), base_bytes.size(), at);
  didx.Upload(idx_bytes.data(), idx_bytes.size());
  dupd.Upload(upd_bytes.data(), upd_bytes.size(), at);
  Cuda(geeps_gpu::ScatterAddRows(nullptr, d, dparams.bytes_ptr() + at, rows,
                                 width, didx.ptr, index64, n,
                                 dupd.bytes_ptr() + at),
       "ScatterAddRows");
  Cuda(cudaDeviceSynchronize(), "ScatterAddRows sync");
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      base[idx[i] * width + j] += updates[i * width + j];
    }
  }
  const auto want = Encode(d, base);
  char what[160];
  std::snprintf(what, sizeof(what),
                "scatter_add %s idx%d rows=%lld width=%lld n=%lld misalign=%lld",
                Name(d), index64 ? 64 : 32, (long long)rows, (long long)width,
                (long long)n, (long long)misalign);
  Check(dparams.Download(want.size(), at) == want, what);
}

// FindBadIndex names the first index outside [0, rows); gather zero-fills
// such rows and scatter-add skips them.
void CheckBadIndices(bool index64) {
  const int64_t rows = 10, width = 3;
  const DType d = geeps_gpu::kFloat32;
  const std::vector<int64_t> idx = {1, 9, 0, index64 ? (int64_t{1} << 40) : 10,
                                    -1, 2};
  const auto idx_bytes = IndexBytes(idx, index64);
  DeviceBuffer didx(idx_bytes.size()), scratch(8);
  didx.Upload(idx_bytes.data(), idx_bytes.size());
  int64_t pos = 0, value = 0;
  const char* tag = index64 ? " idx64" : " idx32";
  Cuda(geeps_gpu::FindBadIndex(nullptr, didx.ptr, index64, idx.size(), rows,
                               scratch.ptr, &pos, &value),
       "FindBadIndex");
  Check(pos == 3 && value == idx[3], std::string("FindBadIndex first bad") + tag);
  Cuda(geeps_gpu::FindBadIndex(nullptr, didx.ptr, index64, 3, rows,
                               scratch.ptr, &pos, &value),
       "FindBadIndex");
  Check(pos == -1, std::string("FindBadIndex none bad") + tag);
  Cuda(geeps_gpu::FindBadIndex(nullptr, didx.ptr, index64, 0, rows,
                               scratch.ptr, &pos, &value),
       "FindBadIndex");
  Check(pos == -1, std::string("FindBadIndex empty") + tag);

  std::vector<double> table(rows * width);
  for (size_t i = 0; i < table.size(); ++i) table[i] = i + 1;
  const auto table_bytes = Encode(d, table);
  DeviceBuffer dparams(table_bytes.size()), dout(idx.size() * width * 4);
  dparams.Upload(table_bytes.data(), table_bytes.size());
  Cuda(geeps_gpu::GatherRows(nullptr, d, dparams.ptr, rows, width, didx.ptr,
                             index64, idx.size(), dout.ptr),
       "GatherRows");
  std::vector<float> got(idx.size() * width);
  std::memcpy(got.data(), dout.Download(got.size() * 4).data(), got.size() * 4);
  bool ok = true;
  for (size_t i = 0; i < idx.size(); ++i) {
    const bool in = idx[i] >= 0 && idx[i] < rows;
    for (int64_t j = 0; j < width; ++j) {
      ok &= got[i * width + j] ==
            (in ? static_cast<float>(table[idx[i] * width + j]) : 0.0f);
    }
  }
  Check(ok, std::string("gather zero-fills out-of-range rows") + tag);

  const auto ones = Encode(d, std::vector<double>(idx.size() * width, 1.0));
  DeviceBuffer dupd(ones.size());
  dupd.Upload(ones.data(), ones.size());
  Cuda(geeps_gpu::ScatterAddRows(nullptr, d, dparams.ptr, rows, width, didx.ptr,
                                 index64, idx.size(), dupd.ptr),
       "ScatterAddRows");
  for (size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] >= 0 && idx[i] < rows) {
      for (int64_t j = 0; j < width; ++j) table[idx[i] * width + j] += 1;
    }
  }
  Check(dparams.Download(table_bytes.size()) == Encode(d, table),
        std::string("scatter_add skips out-of-range rows") + tag);
}

// PackSegments / UnpackSegments over `sizes` segments (more than the 128 one
// launch takes, when asked), with and without a snapshot, assign and add.
void CheckPack(DType d, const std::vector<int64_t>& sizes, std::mt19937_64& rng) {
  const int64_t es = geeps_gpu::DTypeSize(d);
  const int num = static_cast<int>(sizes.size());
  std::vector<int64_t> offsets(num + 1, 0);
  for (int i = 0; i < num; ++i) offsets[i + 1] = offsets[i] + sizes[i];
  const int64_t total = offsets[num];
  std::vector<std::vector<double>> vars(num);
  std::vector<std::unique_ptr<DeviceBuffer>> dvars;
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  for (int i = 0; i < num; ++i) {
    vars[i] = SmallInts(sizes[i], rng);
    const auto bytes = Encode(d, vars[i]);
    dvars.push_back(std::make_unique<DeviceBuffer>(bytes.size()));
    dvars.back()->Upload(bytes.data(), bytes.size());
    srcs.push_back(dvars.back()->ptr);
    dsts.push_back(dvars.back()->ptr);
  }
  const auto snapshot = SmallInts(total, rng);
  const auto snapshot_bytes = Encode(d, snapshot);
  DeviceBuffer dsnap(total * es), dout(total * es);
  dsnap.Upload(snapshot_bytes.data(), snapshot_bytes.size());
  char tag[96];
  std::snprintf(tag, sizeof(tag), " %s segments=%d elements=%lld", Name(d),
                num, (long long)total);

  std::vector<double> flat(total), delta(total);
  for (int i = 0; i < num; ++i) {
    for (int64_t k = 0; k < sizes[i]; ++k) {
      flat[offsets[i] + k] = vars[i][k];
      delta[offsets[i] + k] = vars[i][k] - snapshot[offsets[i] + k];
    }
  }
  Cuda(geeps_gpu::PackSegments(nullptr, d, srcs.data(), offsets.data(), num,
                               nullptr, dout.ptr),
       "PackSegments");
  Check(dout.Download(total * es) == Encode(d, flat), std::string("pack") + tag);
  Cuda(geeps_gpu::PackSegments(nullptr, d, srcs.data(), offsets.data(), num,
                               dsnap.ptr, dout.ptr),
       "PackSegments delta");
  Check(dout.Download(total * es) == Encode(d, delta),
        std::string("pack delta") + tag);

  // Unpack add: each variable becomes var + delta; then assign the snapshot.
  Cuda(geeps_gpu::UnpackSegments(nullptr, d, dout.ptr, dsts.data(),
                                 offsets.data(), num, true),
       "UnpackSegments add");
  bool ok = true;
  for (int i = 0; i < num; ++i) {
    std::vector<double> want(sizes[i]);
    for (int64_t k = 0; k < sizes[i]; ++k) {
      want[k] = vars[i][k] + delta[offsets[i] + k];
    }
    ok &= dvars[i]->Download(sizes[i] * es) == Encode(d, want);
  }
  Check(ok, std::string("unpack add") + tag);
  Cuda(geeps_gpu::UnpackSegments(nullptr, d, dsnap.ptr, dsts.data(),
                                 offsets.data(), num, false),
       "UnpackSegments");
  ok = true;
  for (int i = 0; i < num; ++i) {
    ok &= dvars[i]->Download(sizes[i] * es) ==
          std::vector<uint8_t>(snapshot_bytes.begin() + offsets[i] * es,
                               snapshot_bytes.begin() + offsets[i + 1] * es);
  }
  Check(ok, std::string("unpack assign") + tag);
}

void CheckInvalidDType() {
  DeviceBuffer a(64), b(64);
  const int64_t offsets[2] = {0, 4};
  const void* srcs[1] = {a.ptr};
  Check(geeps_gpu::PackSegments(nullptr, static_cast<DType>(9), srcs, offsets,
                                1, nullptr, b.ptr) != 0,
        "pack refuses an unknown dtype");
  Check(geeps_gpu::ScatterAddRows(nullptr, static_cast<DType>(9), a.ptr, 4, 4,
                                  b.ptr, false, 1, a.ptr) != 0,
        "scatter_add refuses an unknown dtype");
}

// Milliseconds per call of fn, by CUDA events, after warm-up calls.
float Time(const std::function<void()>& fn, int calls = 20) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  for (int i = 0; i < calls; ++i) fn();
  cudaEventRecord(stop);
  Cuda(cudaEventSynchronize(stop), "timing");
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / calls;
}

void Bench() {
  // 1 M rows of 128 float32 gathered / added at random, 512 MiB each way.
  const int64_t rows = 1 << 20, width = 128, n = 1 << 20;
  const size_t moved = n * width * 4;
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> pick(0, rows - 1);
  std::vector<int64_t> idx(n);
  for (auto& v : idx) v = pick(rng);
  const auto idx_bytes = IndexBytes(idx, false);
  DeviceBuffer table(rows * width * 4), didx(idx_bytes.size()), out(moved),
      copy(moved);
  didx.Upload(idx_bytes.data(), idx_bytes.size());
  Cuda(cudaMemset(table.ptr, 0, table.bytes), "memset");
  Cuda(cudaMemset(out.ptr, 0, out.bytes), "memset");
  const float gather = Time([&] {
    geeps_gpu::GatherRows(nullptr, geeps_gpu::kFloat32, table.ptr, rows, width,
                          didx.ptr, false, n, out.ptr);
  });
  const float scatter = Time([&] {
    geeps_gpu::ScatterAddRows(nullptr, geeps_gpu::kFloat32, table.ptr, rows,
                              width, didx.ptr, false, n, out.ptr);
  });
  // The same rows as float16 and bfloat16 (half the bytes).
  float scatter16[2];
  for (int i = 0; i < 2; ++i) {
    const DType d = i == 0 ? geeps_gpu::kFloat16 : geeps_gpu::kBFloat16;
    scatter16[i] = Time([&] {
      geeps_gpu::ScatterAddRows(nullptr, d, table.ptr, rows, width, didx.ptr,
                                false, n, out.ptr);
    });
  }
  const float memcpy_ms = Time([&] {
    cudaMemcpyAsync(copy.ptr, out.ptr, moved, cudaMemcpyDeviceToDevice);
  });
  // Pack / unpack: 200 variables of 655,360 floats (the same 512 MiB).
  const int num = 200;
  const int64_t each = moved / 4 / num;
  std::vector<int64_t> offsets(num + 1);
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  for (int i = 0; i <= num; ++i) offsets[i] = i * each;
  for (int i = 0; i < num; ++i) {
    srcs.push_back(table.bytes_ptr() + i * each * 4);
    dsts.push_back(table.bytes_ptr() + i * each * 4);
  }
  const float pack = Time([&] {
    geeps_gpu::PackSegments(nullptr, geeps_gpu::kFloat32, srcs.data(),
                            offsets.data(), num, nullptr, out.ptr);
  });
  const float pack_delta = Time([&] {
    geeps_gpu::PackSegments(nullptr, geeps_gpu::kFloat32, srcs.data(),
                            offsets.data(), num, copy.ptr, out.ptr);
  });
  const float unpack_add = Time([&] {
    geeps_gpu::UnpackSegments(nullptr, geeps_gpu::kFloat32, out.ptr,
                              dsts.data(), offsets.data(), num, true);
  });
  // The same bytes with odd segment sizes, so no segment after the first
  // starts 16-byte aligned in the buffer.
  for (int i = 0; i <= num; ++i) offsets[i] = i * (each - 1);
  const float pack_odd = Time([&] {
    geeps_gpu::PackSegments(nullptr, geeps_gpu::kFloat32, srcs.data(),
                            offsets.data(), num, nullptr, out.ptr);
  });
  // Bytes read plus written: 2x for gather, copy, pack; 3x for the adds and
  // the delta.
  auto gbs = [&](int times, float ms) { return times * moved / ms / 1e6; };
  std::printf("bench (512 MiB moved each call; GB/s = bytes read + written)\n");
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "d2d cudaMemcpy", memcpy_ms,
              gbs(2, memcpy_ms));
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "gather_rows (1M x 128 f32)",
              gather, gbs(2, gather));
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "scatter_add_rows", scatter,
              gbs(3, scatter));
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "scatter_add_rows f16",
              scatter16[0], gbs(3, scatter16[0]) / 2);
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "scatter_add_rows bf16",
              scatter16[1], gbs(3, scatter16[1]) / 2);
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "pack (200 segments)", pack,
              gbs(2, pack));
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "pack (odd sizes)", pack_odd,
              gbs(2, pack_odd));
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "pack delta", pack_delta,
              gbs(3, pack_delta));
  std::printf("  %-26s %8.3f ms %8.1f GB/s\n", "unpack add", unpack_add,
              gbs(3, unpack_add));
  // What FindBadIndex's wait costs a layer-sized gather (4096 rows, 2 MiB)
  // queued behind other work (a 64 MiB device copy standing in for the
  // step's kernels before it): host wall time per round, 200 rounds, with
  // the check (the host waits for the queue at every call) and without.
  DeviceBuffer scratch(8);
  const int64_t small = 4096;
  auto round_us = [&](bool check) {
    auto one = [&] {
      cudaMemcpyAsync(copy.ptr, out.ptr, 64 << 20, cudaMemcpyDeviceToDevice);
      int64_t pos = 0, value = 0;
      if (check) {
        geeps_gpu::FindBadIndex(nullptr, didx.ptr, false, small, rows,
                                scratch.ptr, &pos, &value);
      }
      geeps_gpu::GatherRows(nullptr, geeps_gpu::kFloat32, table.ptr, rows,
                            width, didx.ptr, false, small, out.ptr);
    };
    for (int i = 0; i < 10; ++i) one();
    Cuda(cudaDeviceSynchronize(), "sync");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) one();
    Cuda(cudaDeviceSynchronize(), "sync");
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now() - start).count() / 200;
  };
  const double unchecked = round_us(false), checked = round_us(true);
  std::printf("  %-26s %8.1f us a round checked, %.1f unchecked\n",
              "index check's wait", checked, unchecked);
  std::printf("{\"gather_vs_memcpy\": %.3f, \"scatter_add_vs_memcpy\": %.3f, "
              "\"pack_vs_memcpy\": %.3f}\n",
              memcpy_ms / gather, memcpy_ms * 1.5 / scatter, memcpy_ms / pack);
}

}  // namespace

int main(int argc, char** argv) {
  bool large = false, bench = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--large") == 0) {
      large = true;
    } else if (std::strcmp(argv[i], "--bench") == 0) {
      bench = true;
    } else {
      std::printf("unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop;
  Cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("device: %s (sm_%d%d), runtime %d, driver %d\n", prop.name,
              prop.major, prop.minor, runtime, driver);

  std::mt19937_64 rng(2016);
  for (DType d : kDTypes) {
    for (bool index64 : {false, true}) {
      for (int64_t width : {1, 3, 8, 64, 129}) {
        for (int64_t misalign : {0, 1}) {
          CheckGather(d, index64, 257, width, 1000, misalign, rng);
          CheckScatterAdd(d, index64, 33, width, 500, misalign, rng);
        }
      }
      CheckGather(d, index64, 5, 4, 0, 0, rng);
      CheckScatterAdd(d, index64, 5, 4, 0, 0, rng);
    }
    CheckPack(d, {3, 0, 1000, 1, 257}, rng);
    CheckPack(d, std::vector<int64_t>(300, 17), rng);   // 3 launches
    // Past one grid pass (2048 blocks x 256 threads x 4 elements).
    CheckPack(d, {(1 << 23) + 3, 5}, rng);
  }
  CheckBadIndices(false);
  CheckBadIndices(true);
  CheckInvalidDType();
  if (large) {
    // One 2-byte element a row: 2^28 rows a grid pass, so n = 2^28 + 3
    // takes the grid-stride loop once more.
    CheckGather(geeps_gpu::kFloat16, false, 1000, 1, (int64_t{1} << 28) + 3, 0,
                rng);
    CheckScatterAdd(geeps_gpu::kFloat32, true, 1000, 1, (int64_t{1} << 28) + 3,
                    0, rng);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  if (bench && g_failed == 0) Bench();
  return g_failed == 0 ? 0 : 1;
}
