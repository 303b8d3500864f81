#include "resilient/torch/checkpoint.hpp"

#include <algorithm>
#include <utility>
#include <vector>

namespace resilient::torch_adapter {
namespace {

using checkpoint::Checkpointer;
using checkpoint::Manifest;
using checkpoint::ReadTarget;
using checkpoint::TensorEntry;
using checkpoint::TensorSpec;
using nlohmann::json;

constexpr const char *kValuesFormat = "resilient.state/1";

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

const TensorEntry *find_entry(const Manifest &m, const std::string &name) {
  auto it = std::find_if(m.tensors.begin(), m.tensors.end(),
                         [&](const TensorEntry &e) { return e.name == name; });
  return it == m.tensors.end() ? nullptr : &*it;
}

// The stored tensor name a {"$tensor": name} reference points at; "" when `ref`
// is not one.
std::string tensor_ref(const json &ref) {
  if (ref.is_object() && ref.size() == 1 && ref.contains("$tensor") && ref["$tensor"].is_string()) {
    return ref["$tensor"].get<std::string>();
  }
  return "";
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
  std::vector<torch::Tensor> keep;
  std::vector<TensorSpec> specs;
  json doc = json::object();
  if (state.model != nullptr) {
    json sd = json::object();
    for (const auto &[name, t] : module_tensors(*state.model)) {
      RESILIENT_RETURN_IF_ERROR(add_spec("model/" + name, t, keep, specs));
      sd[name] = {{"$tensor", "model/" + name}};
    }
    doc["model"] = {{"$stateful", sd}};
  }
  if (state.tensors != nullptr) {
    json ts = json::object();
    for (const auto &[name, t] : *state.tensors) {
      RESILIENT_RETURN_IF_ERROR(add_spec("tensors/" + name, t, keep, specs));
      ts[name] = {{"$tensor", "tensors/" + name}};
    }
    doc["tensors"] = ts;
  }
  doc["values"] = state.values;
  json values = {{"format", kValuesFormat}, {"state", doc}};
  // save() returns once the engine has its own copy, so `keep` may go after it.
  return ckpt.save(step, specs, std::move(values), true);
}

Result<int64_t> load(Checkpointer &ckpt, TrainState &state, std::optional<int64_t> step) {
  if (!step) {
    RESILIENT_ASSIGN_OR_RETURN(auto steps, ckpt.steps());
    if (steps.empty())
      return Status(StatusCode::kNotFound, "no checkpoint in " + ckpt.options().root);
    step = steps.back();
  }
  RESILIENT_ASSIGN_OR_RETURN(Manifest m, ckpt.manifest(*step));
  if (!m.values.is_object() || m.values.value("format", "") != kValuesFormat ||
      !m.values.contains("state")) {
    return Status(
        StatusCode::kVersionMismatch,
        "step " + std::to_string(*step) + ": values are not " + std::string(kValuesFormat));
  }
  const json &doc = m.values["state"];
  std::vector<ReadTarget> targets;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copy_back;  // (destination, staging)
  auto want = [&](const std::string &stored, torch::Tensor dst) -> Status {
    const TensorEntry *e = find_entry(m, stored);
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
    targets.push_back(ReadTarget{stored, into.data_ptr(), e->nbytes, -1});
    return ok_status();
  };
  if (state.model != nullptr) {
    if (!doc.contains("model") || !doc["model"].contains("$stateful")) {
      return Status(StatusCode::kNotFound,
                    "step " + std::to_string(*step) + " has no \"model\" state");
    }
    const json &sd = doc["model"]["$stateful"];
    for (auto &[name, t] : module_tensors(*state.model)) {
      std::string stored = sd.contains(name) ? tensor_ref(sd[name]) : "";
      if (stored.empty())
        return Status(StatusCode::kNotFound,
                      "module tensor '" + name + "' is not in the checkpoint");
      RESILIENT_RETURN_IF_ERROR(want(stored, t.detach()));
    }
  }
  if (state.tensors != nullptr && doc.contains("tensors") && doc["tensors"].is_object()) {
    for (const auto &[name, ref] : doc["tensors"].items()) {
      std::string stored = tensor_ref(ref);
      const TensorEntry *e = stored.empty() ? nullptr : find_entry(m, stored);
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
