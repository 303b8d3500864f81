// resilient._C checkpoint bindings: tensors arrive as buffer descriptors (name, dtype, shape,
// pointer, nbytes, device, stream), so this module never links libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "errors.hpp"
#include "register.hpp"
#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/checkpoint/commit.hpp"

namespace resilient::py {
namespace pyb = pybind11;
using namespace resilient::checkpoint;

namespace {

Duration seconds_or_forever(std::optional<double> s) {
  return s ? from_seconds(std::max(0.0, *s)) : std::chrono::hours(24 * 365);
}

// The descriptor's keys as Python strings made once: a save passes thousands of descriptors,
// and a lookup by C string makes a new Python string each time. Never freed (an object freed
// after the interpreter's end would crash the exit).
struct DescriptorKeys {
  pyb::str name{"name"}, dtype{"dtype"}, shape{"shape"}, ptr{"ptr"}, nbytes{"nbytes"},
      device{"device"}, stream{"stream"}, global_shape{"global_shape"},
      global_offset{"global_offset"};
};

// d[key], or an invalid handle when absent; KeyError when `required`.
pyb::handle item(const pyb::dict& d, const pyb::str& key, bool required) {
  PyObject* v = PyDict_GetItemWithError(d.ptr(), key.ptr());  // borrowed
  if (v == nullptr) {
    if (PyErr_Occurred()) throw pyb::error_already_set();
    if (required) throw pyb::key_error(key.cast<std::string>());
  }
  return v;
}

TensorSpec to_spec(const pyb::dict& d) {
  static const DescriptorKeys* const keys = new DescriptorKeys();
  TensorSpec t;
  t.name = item(d, keys->name, true).cast<std::string>();
  t.dtype = item(d, keys->dtype, true).cast<std::string>();
  t.shape = item(d, keys->shape, true).cast<std::vector<int64_t>>();
  t.data = reinterpret_cast<const void*>(item(d, keys->ptr, true).cast<uintptr_t>());
  t.nbytes = item(d, keys->nbytes, true).cast<uint64_t>();
  if (auto v = item(d, keys->device, false)) t.device = v.cast<int>();
  if (auto v = item(d, keys->stream, false)) t.stream = v.cast<uintptr_t>();
  if (auto v = item(d, keys->global_shape, false)) t.global_shape = v.cast<std::vector<int64_t>>();
  if (auto v = item(d, keys->global_offset, false))
    t.global_offset = v.cast<std::vector<int64_t>>();
  return t;
}

pyb::dict stats_dict(const SaveStats& s) {
  pyb::dict d;
  d["issue_s"] = s.issue_s;
  d["snapshot_s"] = s.snapshot_s;
  d["written_s"] = s.written_s;
  d["durable_s"] = s.durable_s;
  d["bytes"] = s.bytes;
  d["stored_bytes"] = s.stored_bytes;
  return d;
}

pyb::list tensor_list(const Manifest& m) {
  pyb::list out;
  for (const auto& t : m.tensors) {
    pyb::dict d;
    d["name"] = t.name;
    d["dtype"] = t.dtype;
    d["shape"] = t.shape;
    d["nbytes"] = t.nbytes;
    d["shard"] = t.shard;
    d["rank"] = m.shards[t.shard].rank;
    if (!t.global_shape.empty()) {
      d["global_shape"] = t.global_shape;
      d["global_offset"] = t.global_offset;
    }
    out.append(d);
  }
  return out;
}

// A staging made by Checkpointer.stage(), held by Python until save_staged() takes it. The pool
// is declared first so that it outlives the slabs.
struct StagedState {
  std::shared_ptr<memory::HostPool> pool;
  std::optional<Staging> staging;
};

// A save's descriptors converted once and kept by Python while they hold (same pointers, shapes
// and places from save to save): converting a thousand dicts costs about a millisecond of the
// overlapped save's return. Only the CUDA streams are set again on each save.
struct TensorSpecs {
  std::vector<TensorSpec> specs;
};

std::vector<TensorSpec> to_specs(const pyb::list& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back(to_spec(t.cast<pyb::dict>()));
  return specs;
}

SaveMode parse_mode(const std::string& mode) {
  if (mode != "blocking" && mode != "overlap")
    throw pyb::value_error("mode must be 'blocking' or 'overlap'");
  return mode == "overlap" ? SaveMode::kOverlap : SaveMode::kBlocking;
}

// Checkpointer::save_json without the GIL (the blocking mode waits for device copies there).
std::shared_ptr<SaveHandle> save_without_gil(Checkpointer& c, int64_t step,
                                             std::span<const TensorSpec> specs,
                                             const std::string& values_json, bool commit,
                                             SaveMode mode) {
  Result<std::shared_ptr<SaveHandle>> h = Status(StatusCode::kInternal, "unset");
  {
    pyb::gil_scoped_release release;
    h = c.save_json(step, specs, values_json, commit, mode);
  }
  return unwrap(std::move(h));
}

nlohmann::json parse_values(const std::string& values_json) {
  nlohmann::json values = nlohmann::json::parse(values_json, nullptr, false);
  if (values.is_discarded()) throw pyb::value_error("values_json is not valid JSON");
  return values;
}

}  // namespace

void register_checkpoint(pyb::module_& m) {
  pyb::class_<CheckpointOptions>(m, "CheckpointOptions")
      .def(pyb::init(
               [](const std::string& root) { return unwrap(CheckpointOptions::from_env(root)); }),
           pyb::arg("root"), "Options with defaults and RESILIENT_* environment overrides applied.")
      .def_readwrite("root", &CheckpointOptions::root)
      .def_readwrite("keep", &CheckpointOptions::keep)
      .def_readwrite("rank", &CheckpointOptions::rank)
      .def_readwrite("world_size", &CheckpointOptions::world_size)
      .def_readwrite("chunk_bytes", &CheckpointOptions::chunk_bytes)
      .def_readwrite("zstd_level", &CheckpointOptions::zstd_level)
      .def_readwrite("copy_threads", &CheckpointOptions::copy_threads)
      .def_readwrite("restore_threads", &CheckpointOptions::restore_threads)
      .def_readwrite("files_per_rank", &CheckpointOptions::files_per_rank)
      .def_readwrite("background_nice", &CheckpointOptions::background_nice)
      .def_readwrite("background_cpus", &CheckpointOptions::background_cpus)
      .def_property(
          "timeout_s", [](const CheckpointOptions& o) { return to_seconds(o.timeout); },
          [](CheckpointOptions& o, double s) { o.timeout = from_seconds(s); })
      .def_property(
          "pool_bytes", [](const CheckpointOptions& o) { return o.pool.budget_bytes; },
          [](CheckpointOptions& o, uint64_t b) { o.pool.budget_bytes = b; })
      .def_property(
          "slab_bytes", [](const CheckpointOptions& o) { return o.pool.slab_bytes; },
          [](CheckpointOptions& o, uint64_t b) { o.pool.slab_bytes = b; })
      .def_property(
          "request_bytes", [](const CheckpointOptions& o) { return o.io.request_bytes; },
          [](CheckpointOptions& o, uint64_t b) { o.io.request_bytes = b; })
      .def_property(
          "queue_depth", [](const CheckpointOptions& o) { return o.io.queue_depth; },
          [](CheckpointOptions& o, int d) { o.io.queue_depth = d; })
      .def_property(
          "io_uring",
          [](const CheckpointOptions& o) { return std::string(feature_name(o.io.uring)); },
          [](CheckpointOptions& o, const std::string& v) { o.io.uring = unwrap(parse_feature(v)); })
      .def_property(
          "o_direct",
          [](const CheckpointOptions& o) { return std::string(feature_name(o.io.direct)); },
          [](CheckpointOptions& o, const std::string& v) {
            o.io.direct = unwrap(parse_feature(v));
          })
      .def_property(
          "pin_memory",
          [](const CheckpointOptions& o) { return std::string(feature_name(o.pool.pin)); },
          [](CheckpointOptions& o, const std::string& v) {
            o.pool.pin = unwrap(parse_feature(v));
          });

  pyb::class_<SaveHandle, std::shared_ptr<SaveHandle>>(m, "SaveHandle")
      .def_property_readonly("step", &SaveHandle::step)
      .def("done", &SaveHandle::done)
      .def(
          "wait_snapshot",
          [](const SaveHandle& h, std::optional<double> timeout_s) {
            Status s;
            {
              pyb::gil_scoped_release release;
              s = h.wait_snapshot(seconds_or_forever(timeout_s));
            }
            throw_if_error(s);
          },
          pyb::arg("timeout") = pyb::none(),
          "Waits until the snapshot no longer reads the saved tensors (device copies done).")
      .def(
          "fence_stream",
          [](const SaveHandle& h, uintptr_t stream) { throw_if_error(h.fence_stream(stream)); },
          pyb::arg("stream"),
          "Makes the CUDA stream wait on the device for the snapshot's copies (no host block).")
      .def(
          "wait",
          [](const SaveHandle& h, std::optional<double> timeout_s) {
            Status s;
            {
              pyb::gil_scoped_release release;
              s = h.wait(seconds_or_forever(timeout_s));
            }
            throw_if_error(s);
          },
          pyb::arg("timeout") = pyb::none())
      .def("stats", [](const SaveHandle& h) { return stats_dict(h.stats()); });

  pyb::class_<Manifest>(m, "Manifest")
      .def_readonly("step", &Manifest::step)
      .def_readonly("world_size", &Manifest::world_size)
      .def_property_readonly("values_json", [](const Manifest& mf) { return mf.values.dump(); })
      .def_property_readonly("meta_json", [](const Manifest& mf) { return mf.meta.dump(); })
      .def("tensors", &tensor_list)
      .def("to_json", [](const Manifest& mf) { return to_json(mf); });

  m.def(
      "xxh3_hex",
      [](const pyb::bytes& data) {
        std::string_view v = data;
        char buf[17];
        std::snprintf(buf, sizeof buf, "%016llx",
                      static_cast<unsigned long long>(XXH3_64bits(v.data(), v.size())));
        return std::string(buf);
      },
      pyb::arg("data"), "XXH3-64 of `data`, 16 lowercase hex digits (lineage records).");
  m.def(
      "xxh3_buffer",
      [](uintptr_t ptr, size_t nbytes) {
        pyb::gil_scoped_release release;
        return static_cast<uint64_t>(XXH3_64bits(reinterpret_cast<const void*>(ptr), nbytes));
      },
      pyb::arg("ptr"), pyb::arg("nbytes"),
      "XXH3-64 of `nbytes` bytes at address `ptr` (which must stay valid during the call).");
  m.def(
      "word_sums",
      [](const std::vector<uintptr_t>& ptrs, const std::vector<size_t>& sizes) {
        if (ptrs.size() != sizes.size()) throw pyb::value_error("ptrs and sizes differ in length");
        pyb::list out(ptrs.size());
        for (size_t i = 0; i < ptrs.size(); ++i) {
          const auto* p = reinterpret_cast<const unsigned char*>(ptrs[i]);
          const size_t n = sizes[i], n8 = n / 8 * 8;
          uint64_t words = 0;  // wraps, as torch's int64 sum does
          for (size_t k = 0; k < n8; k += 8) {
            uint64_t w;
            std::memcpy(&w, p + k, 8);  // little-endian hosts only (x86-64, aarch64)
            words += w;
          }
          int64_t tail = 256 * static_cast<int64_t>(n);
          for (size_t k = n8; k < n; ++k) tail += p[k];
          out[i] = pyb::make_tuple(static_cast<int64_t>(words), tail);
        }
        return out;
      },
      pyb::arg("ptrs"), pyb::arg("sizes"),
      "For each buffer (address, bytes): the wrapping int64 sum of its 8-byte little-endian "
      "words, and the sum of its tail bytes + 256 x its size (the replica check's fingerprint "
      "of a small host tensor). The buffers must stay valid during the call.");
  m.def(
      "seal_manifest", [](const std::string& text) { return unwrap(seal_manifest(text)); },
      pyb::arg("text"),
      "Reseals a manifest's JSON text (after editing it by hand): docs/FORMAT.md.");
  m.def(
      "parse_manifest",
      [](const std::string& text, const std::string& origin) {
        return unwrap(parse_manifest(text, origin));
      },
      pyb::arg("text"), pyb::arg("origin") = "<string>");

  pyb::class_<StagedState>(m, "StagedState",
                           "Tensors copied into a checkpointer's host pool by "
                           "Checkpointer.stage(); Checkpointer.save_staged() writes them.")
      .def_property_readonly("held", [](const StagedState& s) { return s.staging.has_value(); })
      .def_property_readonly(
          "tensors",
          [](const StagedState& s) { return s.staging ? s.staging->layout.tensors.size() : 0; })
      .def_property_readonly("nbytes",
                             [](const StagedState& s) -> uint64_t {
                               if (!s.staging) return 0;
                               return s.staging->slabs.size() * s.staging->slab_bytes;
                             })
      .def(
          "release", [](StagedState& s) { s.staging.reset(); },
          "Returns the slabs to the pool (a staging that will not be saved).");

  pyb::class_<TensorSpecs>(m, "TensorSpecs",
                           "Tensor descriptors (dicts as for Checkpointer.save) converted once, "
                           "for Checkpointer.save_specs.")
      .def(pyb::init([](const pyb::list& tensors) { return TensorSpecs{to_specs(tensors)}; }),
           pyb::arg("tensors"))
      .def("__len__", [](const TensorSpecs& s) { return s.specs.size(); });

  pyb::class_<Checkpointer>(m, "Checkpointer")
      .def(pyb::init([](const CheckpointOptions& o, Checkpointer* share_pool_with) {
             return unwrap(Checkpointer::create(
                 o, share_pool_with ? share_pool_with->shared_pool() : nullptr));
           }),
           pyb::arg("options"), pyb::arg("share_pool_with") = nullptr)
      .def(
          "stage",
          [](Checkpointer& c, const pyb::list& tensors) {
            std::vector<TensorSpec> specs = to_specs(tensors);
            auto out = std::make_unique<StagedState>();
            out->pool = c.shared_pool();
            Result<Staging> st = Status(StatusCode::kInternal, "unset");
            {
              pyb::gil_scoped_release release;
              st = c.stage(specs);
            }
            out->staging.emplace(unwrap(std::move(st)));
            return out;
          },
          pyb::arg("tensors"),
          "Copies the tensors (descriptors as for save) into the host pool and returns once "
          "every copy completed.")
      .def(
          "save_staged",
          [](Checkpointer& c, int64_t step, StagedState& staged, const pyb::list& keep,
             const pyb::list& extra, const std::string& values_json, bool commit) {
            if (!staged.staging) throw pyb::value_error("this staging was saved or released");
            std::vector<Restaged> kept;
            for (const auto& k : keep) {
              auto t = k.cast<pyb::tuple>();
              kept.push_back(Restaged{t[0].cast<size_t>(), t[1].cast<std::string>(),
                                      t[2].cast<std::vector<int64_t>>(),
                                      t[3].cast<std::vector<int64_t>>()});
            }
            std::vector<TensorSpec> specs = to_specs(extra);
            nlohmann::json values = parse_values(values_json);
            // Taken out while the GIL is held: release() on another thread cannot reach it.
            Staging staging = std::move(*staged.staging);
            staged.staging.reset();
            Result<std::shared_ptr<SaveHandle>> h = Status(StatusCode::kInternal, "unset");
            bool restaged = false;
            {
              pyb::gil_scoped_release release;
              const auto& o = c.options();
              Status s = restage(staging, kept, specs, c.pool(), o.chunk_bytes, o.timeout);
              restaged = s.ok();
              h = restaged ? c.save_staged(step, std::move(staging), std::move(values), commit)
                           : Result<std::shared_ptr<SaveHandle>>(
                                 s.prepend("saving step " + std::to_string(step)));
            }
            if (!restaged) staged.staging.emplace(std::move(staging));  // unchanged: still held
            return unwrap(std::move(h));
          },
          pyb::arg("step"), pyb::arg("staged"), pyb::arg("keep"), pyb::arg("extra"),
          pyb::arg("values_json") = "{}", pyb::arg("commit") = true,
          "Writes a staging as step `step`: `keep` lists (index, name, global_shape, "
          "global_offset) of its tensors to save, `extra` host tensor descriptors to add. The "
          "staging is consumed, even when the save later fails.")
      .def(
          "save",
          [](Checkpointer& c, int64_t step, const pyb::list& tensors,
             const std::string& values_json, bool commit, const std::string& mode) {
            const SaveMode save_mode = parse_mode(mode);
            return save_without_gil(c, step, to_specs(tensors), values_json, commit, save_mode);
          },
          pyb::arg("step"), pyb::arg("tensors"), pyb::arg("values_json") = "{}",
          pyb::arg("commit") = true, pyb::arg("mode") = "blocking")
      .def(
          "save_specs",
          [](Checkpointer& c, int64_t step, TensorSpecs& prepared, const pyb::dict& streams,
             const pyb::list& extra, const std::string& values_json, bool commit,
             const std::string& mode) {
            const SaveMode save_mode = parse_mode(mode);
            std::unordered_map<int, memory::StreamHandle> by_device;
            for (const auto& [device, stream] : streams)
              by_device[device.cast<int>()] = stream.cast<uintptr_t>();
            for (TensorSpec& t : prepared.specs) {
              if (t.device < 0) continue;
              auto it = by_device.find(t.device);
              if (it == by_device.end())
                throw pyb::value_error("tensor " + t.name + ": no stream given for CUDA device " +
                                       std::to_string(t.device));
              t.stream = it->second;
            }
            std::vector<TensorSpec> joined;
            std::span<const TensorSpec> specs = prepared.specs;
            if (!extra.empty()) {
              joined = prepared.specs;
              for (TensorSpec& t : to_specs(extra)) joined.push_back(std::move(t));
              specs = joined;
            }
            return save_without_gil(c, step, specs, values_json, commit, save_mode);
          },
          pyb::arg("step"), pyb::arg("specs"), pyb::arg("streams"), pyb::arg("extra"),
          pyb::arg("values_json") = "{}", pyb::arg("commit") = true, pyb::arg("mode") = "blocking",
          "save() of descriptors converted earlier (TensorSpecs), with each CUDA device's stream "
          "from `streams` and `extra` descriptors (dicts) appended.")
      .def(
          "wait_all",
          [](Checkpointer& c, std::optional<double> timeout_s) {
            Status s;
            {
              pyb::gil_scoped_release release;
              s = c.wait_all(seconds_or_forever(timeout_s));
            }
            throw_if_error(s);
          },
          pyb::arg("timeout") = pyb::none())
      .def("steps", [](const Checkpointer& c) { return unwrap(c.steps()); })
      .def("manifest",
           [](const Checkpointer& c, int64_t step) {
             Result<Manifest> r = Status(StatusCode::kInternal, "unset");
             {
               pyb::gil_scoped_release release;
               r = c.manifest(step);
             }
             return unwrap(std::move(r));
           })
      .def(
          "read",
          [](Checkpointer& c, const Manifest& mf, const pyb::list& targets, int local_ranks,
             uintptr_t queue, int threads) {
            std::vector<ReadTarget> ts;
            for (const auto& item : targets) {
              auto d = item.cast<pyb::dict>();
              ReadTarget t;
              t.name = d["name"].cast<std::string>();
              t.dst = reinterpret_cast<void*>(d["ptr"].cast<uintptr_t>());
              t.nbytes = d["nbytes"].cast<uint64_t>();
              if (d.contains("device")) t.device = d["device"].cast<int>();
              if (d.contains("done"))
                t.done = reinterpret_cast<int64_t*>(d["done"].cast<uintptr_t>());
              if (d.contains("populate")) t.populate = d["populate"].cast<bool>();
              ts.push_back(std::move(t));
            }
            if (queue % alignof(int64_t) != 0)
              throw pyb::value_error("the read queue's words must be 8-byte aligned");
            Status s;
            uint64_t bytes = 0;
            {
              pyb::gil_scoped_release release;
              s = c.read(mf, ts,
                         {.local_ranks = local_ranks,
                          .threads = threads,
                          .queue = reinterpret_cast<int64_t*>(queue),
                          .bytes_read = &bytes});
            }
            throw_if_error(s);
            return bytes;
          },
          pyb::arg("manifest"), pyb::arg("targets"), pyb::arg("local_ranks") = 0,
          pyb::arg("queue") = 0, pyb::arg("threads") = 0,
          "Reads the targets (dicts: name, ptr, nbytes, device, done, populate); returns the "
          "bytes it read. `queue`: the address of two int64 words that the processes reading "
          "the same targets into one shared buffer share (they claim the reads through it; "
          "give them one `threads` count, or their plans may differ).")
      .def("reader_threads", &Checkpointer::reader_threads, pyb::arg("local_ranks") = 0,
           "The reader threads a read would run, `local_ranks` ranks sharing the host's CPUs.")
      .def("verify",
           [](Checkpointer& c, const Manifest& mf) {
             Status s;
             {
               pyb::gil_scoped_release release;
               s = c.verify(mf);
             }
             throw_if_error(s);
           })
      .def_property_readonly("io_backend",
                             [](const Checkpointer& c) { return std::string(c.io_backend()); })
      .def_property_readonly("pool_allocated_bytes",
                             [](Checkpointer& c) { return c.pool().allocated_bytes(); })
      .def_property_readonly("pool_pinned", [](Checkpointer& c) { return c.pool().pinned(); })
      .def(
          "close",
          [](Checkpointer& c, std::optional<double> timeout_s) {
            Status s;
            {
              pyb::gil_scoped_release release;
              s = c.close(seconds_or_forever(timeout_s));
            }
            throw_if_error(s);
          },
          pyb::arg("timeout") = pyb::none());

  m.def(
      "commit_shards",
      [](const std::string& root, int64_t step, int world_size, const std::string& save_id) {
        Status s;
        {
          pyb::gil_scoped_release release;
          s = commit_shards(root, step, world_size, save_id);
        }
        throw_if_error(s);
      },
      pyb::arg("root"), pyb::arg("step"), pyb::arg("world_size"), pyb::arg("save_id"),
      "Merges the rank-<r>.json shard manifests of a multi-rank save and commits the step.");
  m.def(
      "apply_retention",
      [](const std::string& root, int keep) {
        Result<std::vector<int64_t>> r = Status(StatusCode::kInternal, "unset");
        {
          pyb::gil_scoped_release release;
          r = apply_retention(root, keep);
        }
        return unwrap(std::move(r));
      },
      pyb::arg("root"), pyb::arg("keep"), "Deletes committed steps beyond the newest `keep`.");
  m.def("read_latest", [](const std::string& root) { return read_latest(root); });
  m.def("committed_steps", [](const std::string& root) { return unwrap(committed_steps(root)); });
}

}  // namespace resilient::py
