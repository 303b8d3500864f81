// Standalone probe of the io and memory components on a machine (e.g. the GPU machine): loads
// the CUDA runtime through the shim, pins 1 GiB of pool slabs and times it, copies a pinned slab
// with cudaMemcpyAsync + an event, then measures raw O_DIRECT write/read bandwidth of both
// engines at queue depths 1, 4 and 16 (16 MiB requests, 512 MiB of slabs cycled).
//
// Build (after scripts/build.sh), no gtest or Python needed on the target:
//   g++ -O2 -std=c++20 -Icpp/include -Icpp/src benchmarks/raw_io.cpp \
//     build/py/cpp/libresilient_io.a build/py/cpp/libresilient_memory.a
//     build/py/cpp/libresilient_common.a \
//     /usr/lib/x86_64-linux-gnu/liburing.a -ldl -lpthread -static-libstdc++ -static-libgcc \
//     -o build/probe/raw_io
// Run: build/probe/raw_io [dir=/tmp] [GiB=4]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "resilient/io/engine.hpp"
#include "resilient/memory/cuda.hpp"
#include "resilient/memory/pool.hpp"

using namespace resilient;
using clk = std::chrono::steady_clock;
static double secs(clk::time_point t0) {
  return std::chrono::duration<double>(clk::now() - t0).count();
}

int main(int argc, char** argv) {
  const char* dir = argc > 1 ? argv[1] : "/tmp";
  uint64_t gib = argc > 2 ? std::stoull(argv[2]) : 4;
  const memory::CudaRuntime* cuda = memory::CudaRuntime::get();
  std::printf("cuda: %s reason='%s'\n", cuda ? "loaded" : "none",
              memory::CudaRuntime::unavailable_reason());
  if (cuda) {
    std::printf("device_count=%d\n", cuda->device_count());
    auto d = cuda->get_device();
    std::printf("get_device ok=%d\n", d.ok());
    memory::PoolOptions po;
    po.slab_bytes = 64ull << 20;
    po.budget_bytes = 2ull << 30;
    memory::HostPool pool(po);
    auto t0 = clk::now();
    Status st = pool.reserve(1ull << 30);
    std::printf("pinned=%d reserve 1GiB: %s in %.3f s\n", pool.pinned(), st.to_string().c_str(),
                secs(t0));
    auto a = pool.acquire(std::chrono::seconds(5));
    auto b = pool.acquire(std::chrono::seconds(5));
    std::printf("slab pinned=%d\n", a.ok() && a->pinned());
    std::memset(a->data(), 0x5a, a->size());
    memory::StreamHandle s = 0;
    memory::EventHandle e = 0;
    std::printf("stream_create: %s\n", cuda->stream_create(&s).to_string().c_str());
    std::printf("event_create: %s\n", cuda->event_create(&e).to_string().c_str());
    t0 = clk::now();
    std::printf("memcpy_async: %s\n",
                cuda->memcpy_async(b->data(), a->data(), a->size(), memory::CopyKind::kDefault, s)
                    .to_string()
                    .c_str());
    std::printf("event_record: %s\n", cuda->event_record(e, s).to_string().c_str());
    std::printf("event_wait: %s (%.4f s)\n",
                cuda->event_wait(e, std::chrono::seconds(10)).to_string().c_str(), secs(t0));
    std::printf("copy correct=%d\n", std::memcmp(a->data(), b->data(), a->size()) == 0);
    std::printf("stream_sync: %s\n", cuda->stream_synchronize(s).to_string().c_str());
    cuda->event_destroy(e);
    cuda->stream_destroy(s);
    a->release();
    b->release();
    t0 = clk::now();
    pool.trim();
    std::printf("trim (unpin 1GiB): %.3f s\n", secs(t0));
  }
  // Raw io bandwidth.
  const uint64_t bytes = gib << 30;
  for (int qd : {1, 4, 16}) {
    for (bool uring : {true, false}) {
      io::IoOptions o;
      o.uring = uring ? Feature::kOn : Feature::kOff;
      o.queue_depth = qd;
      o.threads = qd;
      o.request_bytes = 16ull << 20;
      auto eng = io::IoEngine::create(o);
      if (!eng.ok()) {
        std::printf("engine: %s\n", eng.status().to_string().c_str());
        continue;
      }
      memory::PoolOptions po;
      po.slab_bytes = 16ull << 20;
      po.budget_bytes = 512ull << 20;
      po.pin = Feature::kOff;
      memory::HostPool pool(po);
      std::vector<memory::Slab> slabs;
      for (int i = 0; i < 32; ++i)
        slabs.push_back(std::move(pool.acquire(std::chrono::seconds(5))).value());
      for (auto& s : slabs) std::memset(s.data(), 0x33, s.size());
      std::vector<iovec> iov;
      for (auto& [p, n] : pool.slabs()) iov.push_back({p, n});
      bool reg = uring && (*eng)->register_buffers(iov).ok();
      std::vector<io::IoRequest> reqs;
      for (uint64_t off = 0, k = 0; off < bytes; off += o.request_bytes, ++k)
        reqs.push_back({slabs[k % slabs.size()].data(), o.request_bytes, off});
      std::string path = std::string(dir) + "/probe.bin";
      auto t0 = clk::now();
      auto f = io::File::create(path, Feature::kAuto);
      if (!f.ok()) {
        std::printf("create: %s\n", f.status().to_string().c_str());
        return 1;
      }
      Status w = (*eng)->write(*f, reqs, std::chrono::seconds(300));
      Status sy = f->sync();
      f->close();
      double wt = secs(t0);
      auto r = io::File::open_read(path, Feature::kAuto);
      t0 = clk::now();
      Status rd = (*eng)->read(*r, reqs, std::chrono::seconds(300));
      double rt = secs(t0);
      std::printf("%-8s QD=%2d direct=%d fixed=%d write %.2f GB/s (%s %s) read %.2f GB/s (%s)\n",
                  (*eng)->name(), qd, r->direct(), reg, bytes / wt / 1e9, w.to_string().c_str(),
                  sy.to_string().c_str(), bytes / rt / 1e9, rd.to_string().c_str());
      ::unlink(path.c_str());
    }
  }
  return 0;
}
