#pragma once
// Checkpointing libtorch state with the resilient engine, in the same format
// and layout as the Python API: a checkpoint saved here loads in Python with
//   Checkpointer(root).load({"model": module, "tensors": {...}, "values":
//   {...}})
// and a checkpoint saved from Python with that structure loads here.
//
// Layout of the state document (rank 0's "state" in the values of format
// "resilient.sharded/1", each tensor stored whole as "S/<name>#@0_0..."):
//   {"model": {"$stateful": {"<param or buffer name>": {"$tensor":
//   "model/<name>"}, ...}},
//    "tensors": {"<name>": {"$tensor": "tensors/<name>"}, ...},
//    "values": <free JSON: step, epoch, ...>}
// Only CPU tensors are supported here (GPU tensors are copied to the CPU
// first).

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/common/status.hpp"

namespace resilient::torch_adapter {

/// What a libtorch program checkpoints: a module's parameters and buffers,
/// loose tensors, and plain JSON values. Pointers are borrowed: they must
/// outlive the save() or load() call.
struct TrainState {
  torch::nn::Module *model = nullptr;
  std::map<std::string, torch::Tensor> *tensors = nullptr;
  nlohmann::json values = nlohmann::json::object();
};

/// Snapshots `state`, writes it and commits it (lineage record, merged manifest:
/// the commit Python's rank 0 makes); returns once the step is committed.
/// Errors: kInvalidArgument (unsupported dtype, undefined tensor), those
/// of Checkpointer::save. Thread safety: as Checkpointer::save (one caller at a
/// time).
Result<std::shared_ptr<checkpoint::SaveHandle>> save(checkpoint::Checkpointer &ckpt, int64_t step,
                                                     TrainState &state);

/// Loads `step` (or the head of the root's lineage) into `state` in place:
/// parameters and buffers by name (dtype and shape must match: kInvalidArgument
/// naming the tensor), tensors in `state.tensors` (created when absent), and
/// `state.values`. Returns the step loaded; kNotFound when there is no
/// checkpoint; kCorrupt / kVersionMismatch from verification.
Result<int64_t> load(checkpoint::Checkpointer &ckpt, TrainState &state,
                     std::optional<int64_t> step = std::nullopt);

/// "float32" for torch::kFloat32 (the names the format and Python use); "" if
/// unsupported.
std::string dtype_name(torch::ScalarType t);

}  // namespace resilient::torch_adapter
