// A small libtorch training program checkpointed with resilient (cpp/adapter).
// It resumes from the newest checkpoint under ROOT, trains a two-layer MLP on
// synthetic data up to STEPS, and saves. The checkpoint is the same format as
// the Python API's: Python can load it into a module with the same parameter
// names (fc1, fc2), and this program loads Python's.
//
//   resilient_train_example ROOT STEPS            train (resuming) and save at
//   STEPS resilient_train_example ROOT --print          load the newest
//   checkpoint and print it
// Prints "step S checksum C loss L" (C: sum of all parameters in float64, as
// %a).
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "resilient/checkpoint/checkpointer.hpp"
#include "resilient/torch/checkpoint.hpp"

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

double checksum(Net &net) {
  double sum = 0;
  for (const auto &p : net.named_parameters(true))
    sum += p.value().detach().to(torch::kFloat64).sum().item<double>();
  return sum;
}

int fail(const resilient::Status &s) {
  std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s ROOT STEPS|--print\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  const bool print_only = std::string(argv[2]) == "--print";
  const int64_t steps = print_only ? 0 : std::atoll(argv[2]);
  torch::manual_seed(0);
  torch::set_num_threads(1);
  Net net;
  std::map<std::string, torch::Tensor> tensors;
  resilient::torch_adapter::TrainState state{&net, &tensors, {{"step", 0}}};

  auto options = resilient::checkpoint::CheckpointOptions::from_env(root);
  if (!options.ok()) return fail(options.status());
  auto ckpt = resilient::checkpoint::Checkpointer::create(*options);
  if (!ckpt.ok()) return fail(ckpt.status());
  int64_t step = 0;
  auto loaded = resilient::torch_adapter::load(**ckpt, state);
  if (loaded.ok()) {
    step = state.values.value("step", *loaded);
  } else if (loaded.status().code() != resilient::StatusCode::kNotFound) {
    return fail(loaded.status());
  }
  if (print_only) {
    std::printf("step %lld checksum %a tensors %zu\n", static_cast<long long>(step), checksum(net),
                tensors.size());
    return 0;
  }
  // Synthetic regression data; the batch depends only on the step, so a resumed
  // run sees the same batches as an uninterrupted one.
  auto gen = at::detail::createCPUGenerator(7);
  torch::Tensor w = torch::randn({8, 1}, gen);
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.05));
  double loss_value = 0;
  for (; step < steps; ++step) {
    auto g = at::detail::createCPUGenerator(1000 + step);
    torch::Tensor x = torch::randn({32, 8}, g);
    torch::Tensor loss = torch::mse_loss(net.forward(x), x.matmul(w));
    opt.zero_grad();
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
  }
  state.values["step"] = step;
  tensors["data_weight"] = w;
  auto handle = resilient::torch_adapter::save(**ckpt, step, state);
  if (!handle.ok()) return fail(handle.status());
  if (auto s = (*handle)->wait(std::chrono::seconds(120)); !s.ok()) return fail(s);
  std::printf("step %lld checksum %a loss %a\n", static_cast<long long>(step), checksum(net),
              loss_value);
  return 0;
}
