#include "resilient/torch/checkpoint.hpp"

#include <unistd.h>
#include <xxhash.h>

#include <cstdio>

#include <algorithm>
#include <utility>
#include <vector>

#include "resilient/checkpoint/commit.hpp"
#include "resilient/checkpoint/format.hpp"
#include "resilient/io/file.hpp"

namespace resilient::torch_adapter {
namespace {

using checkpoint::Checkpointer;
using checkpoint::Manifest;
using checkpoint::ReadTarget;
using checkpoint::TensorEntry;
using checkpoint::TensorSpec;
using nlohmann::json;

// The one format of every world size (python/resilient/checkpoint/checkpointer.py): one rank's
// values carry its state document; commit_shards merges them into "resilient.sharded/1".
constexpr const char *kRankFormat = "resilient.sharded-rank/1";
constexpr const char *kFormat = "resilient.sharded/1";

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Stored name of a whole (unsplit) tensor: "S/<name>#@0_0..." (python's plan.piece_name).
std::string piece_name(const std::string &name, size_t dims) {
  std::string out = "S/" + name + "#@";
  for (size_t i = 0; i < dims; ++i) out += i ? "_0" : "0";
  return out;
}

// The lineage record of a committed step (root.py: a line of JSON, then its XXH3-64 in hex):
// seq, or nullopt for none or a damaged one.
std::optional<int64_t> lineage_seq(const std::string &root, int64_t step) {
  auto text =
      io::read_small_file(root + "/" + checkpoint::step_dir_name(step) + "/lineage.json", 4096);
  if (!text.ok()) return std::nullopt;
  const auto nl = text->find('\n');
  if (nl == std::string::npos) return std::nullopt;
  const std::string body = text->substr(0, nl);
  std::string digest = text->substr(nl + 1);
  while (!digest.empty() && digest.back() == '\n') digest.pop_back();
  if (digest != hex64(XXH3_64bits(body.data(), body.size()))) return std::nullopt;
  json doc = json::parse(body, nullptr, false);
  if (!doc.is_object() || !doc.contains("seq") || !doc["seq"].is_number_integer())
    return std::nullopt;
  return doc["seq"].get<int64_t>();
}

// The head of the root's current lineage (the commit with the largest seq; the newest step of
// a root without lineage records), and the largest seq. This adapter never rolls back, so the
// head is the parent of its next commit.
struct Head {
  std::optional<int64_t> step, seq;
  int64_t max_seq = 0;
};

Result<Head> lineage_head(const std::string &root) {
  RESILIENT_ASSIGN_OR_RETURN(auto steps, checkpoint::committed_steps(root));
  Head h;
  for (int64_t s : steps) {
    auto seq = lineage_seq(root, s);
    if (seq && *seq >= h.max_seq) {
      h.max_seq = *seq;
      h.step = s;
      h.seq = seq;
    }
  }
  if (!h.step && !steps.empty()) h.step = steps.back();
  return h;
}

Status ensure_root(const std::string &root) {
  RESILIENT_RETURN_IF_ERROR(io::make_dirs(root));
  auto marker = io::read_small_file(root + "/resilient-root.json", 4096);
  if (marker.ok()) return ok_status();
  return io::write_file_atomic(root + "/resilient-root.json",
                               "{\"format\": \"resilient-root\", \"version\": 1}\n");
}

const std::vector<std::pair<torch::ScalarType, const char *>> &dtype_table() {
  static const std::vector<std::pair<torch::ScalarType, const char *>> table = {
      {torch::kFloat64, "float64"},
      {torch::kFloat32, "float32"},
      {torch::kFloat16, "float16"},
      {torch::kBFloat16, "bfloat16"},
      {torch::kInt64, "int64"},
      {torch::kInt32, "int32"},
      {torch::kInt16, "int16"},
      {torch::kInt8, "int8"},
      {torch::kUInt8, "uint8"},
      {torch::kBool, "bool"},
      {torch::kComplexFloat, "complex64"},
      {torch::kComplexDouble, "complex128"}};
  return table;
}

std::optional<torch::ScalarType> dtype_from_name(const std::string &name) {
  for (const auto &[t, n] : dtype_table()) {
    if (name == n) return t;
  }
  return std::nullopt;
}

// Host, contiguous, dense: what the engine reads from and writes into.
torch::Tensor host_contiguous(const torch::Tensor &t) {
  return t.detach().to(torch::kCPU).contiguous();
}

Status add_spec(const std::string &name, const torch::Tensor &t, std::vector<torch::Tensor> &keep,
                std::vector<TensorSpec> &specs) {
  if (!t.defined())
    return Status(StatusCode::kInvalidArgument, "tensor '" + name + "' is undefined");
  std::string dtype = dtype_name(t.scalar_type());
  if (dtype.empty()) {
    return Status(StatusCode::kInvalidArgument, "tensor '" + name + "': dtype " +
                                                    std::string(c10::toString(t.scalar_type())) +
                                                    " is not supported");
  }
  torch::Tensor h = host_contiguous(t);
  keep.push_back(h);
  TensorSpec s;
  s.name = name;
  s.dtype = dtype;
  s.shape = h.sizes().vec();
  s.data = h.data_ptr();
  s.nbytes = static_cast<uint64_t>(h.numel()) * h.element_size();
  specs.push_back(std::move(s));
  return ok_status();
}

std::vector<std::pair<std::string, torch::Tensor>> module_tensors(torch::nn::Module &m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto &p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto &b : m.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

// The stored tensor name a {"$tensor": name} reference points at; "" when `ref`
// is not one.
std::string tensor_ref(const json &ref) {
  if (ref.is_object() && ref.size() == 1 && ref.contains("$tensor") && ref["$tensor"].is_string()) {
    return ref["$tensor"].get<std::string>();
  }
  return "";
}

// A saved dict as a JSON object: a plain object, or the {"$odict"/"$dict": [[key, value]...]}
// pairs Python writes for ordered dicts (string keys only here); null for anything else.
json plain_object(const json &d) {
  if (!d.is_object()) return json();
  for (const char *tag : {"$odict", "$dict"}) {
    if (d.size() == 1 && d.contains(tag)) {
      json out = json::object();
      if (!d[tag].is_array()) return json();
      for (const auto &p : d[tag]) {
        if (!p.is_array() || p.size() != 2 || !p[0].is_string()) return json();
        out[p[0].get<std::string>()] = p[1];
      }
      return out;
    }
  }
  return d;
}

}  // namespace

std::string dtype_name(torch::ScalarType t) {
  for (const auto &[type, name] : dtype_table()) {
    if (type == t) return name;
  }
  return "";
}

Result<std::shared_ptr<checkpoint::SaveHandle>> save(Checkpointer &ckpt, int64_t step,
                                                     TrainState &state) {
  const auto &opts = ckpt.options();
  if (opts.world_size != 1) {
    return Status(StatusCode::kInvalidArgument,
                  "the libtorch adapter saves from one process (world_size 1)");
  }
  std::vector<torch::Tensor> keep;
  std::vector<TensorSpec> specs;
  json doc = json::object();
  auto add = [&](const std::string &name, const torch::Tensor &t) -> Status {
    RESILIENT_RETURN_IF_ERROR(add_spec(name, t, keep, specs));
    TensorSpec &spec = specs.back();
    spec.name = piece_name(name, spec.shape.size());
    spec.global_shape = spec.shape;
    spec.global_offset.assign(spec.shape.size(), 0);
    return ok_status();
  };
  if (state.model != nullptr) {
    json sd = json::object();
    for (const auto &[name, t] : module_tensors(*state.model)) {
      RESILIENT_RETURN_IF_ERROR(add("model/" + name, t));
      sd[name] = {{"$tensor", "model/" + name}};
    }
    doc["model"] = {{"$stateful", sd}};
  }
  if (state.tensors != nullptr) {
    json ts = json::object();
    for (const auto &[name, t] : *state.tensors) {
      RESILIENT_RETURN_IF_ERROR(add("tensors/" + name, t));
      ts[name] = {{"$tensor", "tensors/" + name}};
    }
    doc["tensors"] = ts;
  }
  doc["values"] = state.values;
  const std::string save_id = "cpp-" + std::to_string(step) + "-" + std::to_string(::getpid());
  json values = {{"format", kRankFormat}, {"save_id", save_id}, {"rank", 0},
                 {"world_size", 1},       {"state", doc},       {"rank_state", nullptr}};
  RESILIENT_RETURN_IF_ERROR(ensure_root(opts.root));
  // The engine writes the shard and its rank manifest; then the commit below, as Python's
  // rank 0 does: lineage record, merged manifest, rename. Returns once committed.
  RESILIENT_ASSIGN_OR_RETURN(auto handle, ckpt.save(step, specs, std::move(values), false));
  RESILIENT_RETURN_IF_ERROR(handle->wait(opts.timeout));
  RESILIENT_ASSIGN_OR_RETURN(Head head, lineage_head(opts.root));
  json lineage = {{"seq", head.max_seq + 1}, {"step", step}, {"parent", nullptr}};
  if (head.step)
    lineage["parent"] = {{"step", *head.step}, {"seq", head.seq ? json(*head.seq) : json()}};
  const std::string body = lineage.dump();
  RESILIENT_RETURN_IF_ERROR(
      io::write_file_atomic(checkpoint::tmp_dir_path(opts.root, step) + "/lineage.json",
                            body + "\n" + hex64(XXH3_64bits(body.data(), body.size())) + "\n"));
  RESILIENT_RETURN_IF_ERROR(checkpoint::commit_shards(opts.root, step, 1, save_id));
  return handle;
}

Result<int64_t> load(Checkpointer &ckpt, TrainState &state, std::optional<int64_t> step) {
  if (!step) {
    RESILIENT_ASSIGN_OR_RETURN(Head head, lineage_head(ckpt.options().root));
    if (!head.step) return Status(StatusCode::kNotFound, "no checkpoint in " + ckpt.options().root);
    step = head.step;
  }
  RESILIENT_ASSIGN_OR_RETURN(Manifest m, ckpt.manifest(*step));
  const json *ranks =
      m.values.is_object() && m.values.value("format", "") == kFormat && m.values.contains("ranks")
          ? &m.values["ranks"]
          : nullptr;
  if (ranks == nullptr || !ranks->is_array() || ranks->empty() || !(*ranks)[0].is_object() ||
      !(*ranks)[0].contains("state") || !(*ranks)[0]["state"].is_object()) {
    return Status(StatusCode::kVersionMismatch,
                  "step " + std::to_string(*step) + ": values are not " + std::string(kFormat));
  }
  const json doc = plain_object((*ranks)[0]["state"]);
  std::vector<ReadTarget> targets;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copy_back;  // (destination, staging)
  // A logical tensor is stored as pieces "S/<name>#@<offset>"; this adapter reads whole ones.
  auto find_whole = [&](const std::string &name) -> Result<const TensorEntry *> {
    const TensorEntry *e = nullptr;
    const std::string prefix = "S/" + name + "#@";
    for (const auto &t : m.tensors) {
      if (t.name.rfind(prefix, 0) != 0) continue;
      if (e != nullptr || (!t.global_shape.empty() && t.global_shape != t.shape)) {
        return Status(
            StatusCode::kInvalidArgument,
            "tensor '" + name +
                "' is stored in pieces (saved by several ranks or sharded); "
                "the libtorch adapter reads whole tensors: assemble it in Python (read_global)");
      }
      e = &t;
    }
    return e;
  };
  auto want = [&](const std::string &stored, torch::Tensor dst) -> Status {
    RESILIENT_ASSIGN_OR_RETURN(const TensorEntry *e, find_whole(stored));
    if (e == nullptr)
      return Status(StatusCode::kNotFound, "tensor '" + stored + "' is not in the checkpoint");
    if (e->dtype != dtype_name(dst.scalar_type()) || e->shape != dst.sizes().vec()) {
      return Status(StatusCode::kInvalidArgument,
                    "tensor '" + stored + "': checkpoint has " + e->dtype + json(e->shape).dump() +
                        ", the target has " + dtype_name(dst.scalar_type()) +
                        json(dst.sizes().vec()).dump());
    }
    torch::Tensor into = dst;
    if (!dst.device().is_cpu() || !dst.is_contiguous()) {
      into = torch::empty(
          dst.sizes(),
          dst.options().device(torch::kCPU).memory_format(c10::MemoryFormat::Contiguous));
      copy_back.emplace_back(dst, into);
    }
    targets.push_back(ReadTarget{e->name, into.data_ptr(), e->nbytes, -1});
    return ok_status();
  };
  if (state.model != nullptr) {
    if (!doc.contains("model") || !doc["model"].contains("$stateful")) {
      return Status(StatusCode::kNotFound,
                    "step " + std::to_string(*step) + " has no \"model\" state");
    }
    const json sd = plain_object(doc["model"]["$stateful"]);
    for (auto &[name, t] : module_tensors(*state.model)) {
      std::string stored = sd.contains(name) ? tensor_ref(sd[name]) : "";
      if (stored.empty())
        return Status(StatusCode::kNotFound,
                      "module tensor '" + name + "' is not in the checkpoint");
      RESILIENT_RETURN_IF_ERROR(want(stored, t.detach()));
    }
  }
  const json loose = doc.contains("tensors") ? plain_object(doc["tensors"]) : json();
  if (state.tensors != nullptr && loose.is_object()) {
    for (const auto &[name, ref] : loose.items()) {
      std::string stored = tensor_ref(ref);
      const TensorEntry *e = nullptr;
      if (!stored.empty()) {
        RESILIENT_ASSIGN_OR_RETURN(e, find_whole(stored));
      }
      if (e == nullptr)
        return Status(StatusCode::kCorrupt, "tensor reference '" + name + "' is malformed");
      auto it = state.tensors->find(name);
      if (it == state.tensors->end() || !it->second.defined()) {
        auto dtype = dtype_from_name(e->dtype);
        if (!dtype)
          return Status(StatusCode::kInvalidArgument, "tensor '" + name + "': dtype " + e->dtype);
        (*state.tensors)[name] = torch::empty(e->shape, torch::TensorOptions().dtype(*dtype));
      }
      RESILIENT_RETURN_IF_ERROR(want(stored, (*state.tensors)[name].detach()));
    }
  }
  RESILIENT_RETURN_IF_ERROR(ckpt.read(m, targets));
  {
    torch::NoGradGuard no_grad;
    for (auto &[dst, staging] : copy_back) dst.copy_(staging);
  }
  if (doc.contains("values")) state.values = doc["values"];
  return *step;
}

}  // namespace resilient::torch_adapter
