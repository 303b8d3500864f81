// resilient._C straggler bindings: robust statistics, options and the detector.
// A window is passed as rows [steps, step_s, compute_s, host_s, wait_s], one per rank (the layout
// the Python monitor all-gathers); NaN marks a phase that was not measured.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "errors.hpp"
#include "register.hpp"
#include "resilient/straggler/detector.hpp"
#include "resilient/straggler/stats.hpp"

namespace resilient::py {
namespace pyb = pybind11;
namespace st = resilient::straggler;

namespace {

constexpr size_t kRowWidth = 2 + st::kNumPhases;

Result<st::WindowInput> window_from_rows(int64_t first_step, int64_t last_step,
                                         const std::vector<std::vector<double>>& rows) {
  st::WindowInput in;
  in.first_step = first_step;
  in.last_step = last_step;
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].size() != kRowWidth) {
      return Status(StatusCode::kInvalidArgument,
                    "row " + std::to_string(r) + " has " + std::to_string(rows[r].size()) +
                        " values, expected [steps, step_s, compute_s, host_s, wait_s]");
    }
    st::RankWindow w;
    w.steps = static_cast<int64_t>(rows[r][0]);
    w.step_s = rows[r][1];
    for (int p = 0; p < st::kNumPhases; ++p) w.phase_s[p] = rows[r][2 + p];
    in.ranks.push_back(w);
  }
  return in;
}

}  // namespace

void register_straggler(pyb::module_& m) {
  pyb::module_ s = m.def_submodule("straggler", "Straggler detection core");

  pyb::enum_<st::Phase>(s, "Phase")
      .value("COMPUTE", st::Phase::kCompute)
      .value("HOST", st::Phase::kHost)
      .value("WAIT", st::Phase::kWait);
  s.def("phase_name", [](st::Phase p) { return std::string(st::phase_name(p)); });

  s.def(
      "median", [](const std::vector<double>& v) { return st::median(v); },
      "Median of the finite values (NaN when none).");
  s.def(
      "mad", [](const std::vector<double>& v, double c) { return st::mad(v, c); },
      "Median absolute deviation of the finite values around center.");
  s.def(
      "summarize",
      [](const std::vector<double>& v) {
        st::RobustSummary r = st::summarize(v);
        return pyb::make_tuple(r.median, r.mad, r.count);
      },
      "(median, mad, count) of the finite values.");

  pyb::class_<st::StragglerOptions>(s, "StragglerOptions")
      .def(pyb::init<>())
      .def_static("from_env", [] { return unwrap(st::StragglerOptions::from_env()); })
      .def("validate", [](const st::StragglerOptions& o) { throw_if_error(o.validate()); })
      .def_readwrite("interval", &st::StragglerOptions::interval)
      .def_readwrite("slow_ratio", &st::StragglerOptions::slow_ratio)
      .def_readwrite("z_threshold", &st::StragglerOptions::z_threshold)
      .def_readwrite("min_ratio", &st::StragglerOptions::min_ratio)
      .def_readwrite("mad_floor", &st::StragglerOptions::mad_floor)
      .def_readwrite("min_step_fraction", &st::StragglerOptions::min_step_fraction)
      .def_readwrite("min_ranks", &st::StragglerOptions::min_ranks)
      .def_readwrite("history_windows", &st::StragglerOptions::history_windows)
      .def_readwrite("report_after", &st::StragglerOptions::report_after)
      .def_property(
          "cusum_drift", [](const st::StragglerOptions& o) { return o.cusum.drift; },
          [](st::StragglerOptions& o, double v) { o.cusum.drift = v; })
      .def_property(
          "cusum_threshold", [](const st::StragglerOptions& o) { return o.cusum.threshold; },
          [](st::StragglerOptions& o, double v) { o.cusum.threshold = v; })
      .def_property(
          "cusum_clip", [](const st::StragglerOptions& o) { return o.cusum.clip; },
          [](st::StragglerOptions& o, double v) { o.cusum.clip = v; })
      .def_property(
          "cusum_cap", [](const st::StragglerOptions& o) { return o.cusum.cap; },
          [](st::StragglerOptions& o, double v) { o.cusum.cap = v; });

  pyb::class_<st::PhaseScore>(s, "PhaseScore")
      .def_readonly("value", &st::PhaseScore::value)
      .def_readonly("median", &st::PhaseScore::median)
      .def_readonly("ratio", &st::PhaseScore::ratio)
      .def_readonly("z", &st::PhaseScore::z)
      .def_readonly("slow", &st::PhaseScore::slow);

  pyb::class_<st::RankScore>(s, "RankScore")
      .def_readonly("rank", &st::RankScore::rank)
      .def_readonly("phases", &st::RankScore::phases)
      .def_readonly("worst_phase", &st::RankScore::worst_phase)
      .def_readonly("ratio", &st::RankScore::ratio)
      .def_readonly("z", &st::RankScore::z)
      .def_readonly("slow", &st::RankScore::slow)
      .def_readonly("evidence", &st::RankScore::evidence)
      .def_readonly("cusum", &st::RankScore::cusum)
      .def_readonly("persistent", &st::RankScore::persistent)
      .def_readonly("self_ratio", &st::RankScore::self_ratio)
      .def_readonly("slow_streak", &st::RankScore::slow_streak);

  pyb::class_<st::StragglerReport>(s, "StragglerReport")
      .def_readonly("rank", &st::StragglerReport::rank)
      .def_readonly("phase", &st::StragglerReport::phase)
      .def_readonly("ratio", &st::StragglerReport::ratio)
      .def_readonly("z", &st::StragglerReport::z)
      .def_readonly("value_s", &st::StragglerReport::value_s)
      .def_readonly("median_s", &st::StragglerReport::median_s)
      .def_readonly("self_ratio", &st::StragglerReport::self_ratio)
      .def_readonly("since_step", &st::StragglerReport::since_step)
      .def_readonly("last_step", &st::StragglerReport::last_step)
      .def_readonly("persistent", &st::StragglerReport::persistent)
      .def_readonly("cusum", &st::StragglerReport::cusum)
      .def_readonly("flagged_windows", &st::StragglerReport::flagged_windows)
      .def_readonly("slow_streak", &st::StragglerReport::slow_streak)
      .def("__str__", &st::StragglerReport::to_string)
      .def("__repr__", [](const st::StragglerReport& r) { return "<" + r.to_string() + ">"; });

  pyb::class_<st::WindowResult>(s, "WindowResult")
      .def_readonly("window", &st::WindowResult::window)
      .def_readonly("first_step", &st::WindowResult::first_step)
      .def_readonly("last_step", &st::WindowResult::last_step)
      .def_readonly("scores", &st::WindowResult::scores)
      .def_readonly("reports", &st::WindowResult::reports)
      .def_readonly("newly_persistent", &st::WindowResult::newly_persistent)
      .def_readonly("recovered", &st::WindowResult::recovered);

  pyb::class_<st::StragglerDetector>(s, "StragglerDetector")
      .def(pyb::init([](const st::StragglerOptions& o, int world_size) {
             return unwrap(st::StragglerDetector::create(o, world_size));
           }),
           pyb::arg("options"), pyb::arg("world_size"))
      .def(
          "update",
          [](st::StragglerDetector& d, int64_t first_step, int64_t last_step,
             const std::vector<std::vector<double>>& rows) {
            st::WindowInput in = unwrap(window_from_rows(first_step, last_step, rows));
            return unwrap(d.update(in));
          },
          pyb::arg("first_step"), pyb::arg("last_step"), pyb::arg("rows"),
          "Scores one window; rows[r] = [steps, step_s, compute_s, host_s, wait_s].")
      .def_property_readonly("world_size", &st::StragglerDetector::world_size)
      .def_property_readonly("windows", &st::StragglerDetector::windows)
      .def_property_readonly("options", &st::StragglerDetector::options)
      .def(
          "cusum",
          [](const st::StragglerDetector& d, int rank) {
            if (rank < 0 || rank >= d.world_size()) throw pyb::index_error("rank out of range");
            const st::CusumState& c = d.cusum_state(rank);
            return pyb::make_tuple(c.sum, c.run_start, c.persistent, c.flagged_windows);
          },
          "(sum, run_start, persistent, flagged_windows) of a rank's CUSUM.")
      .def("reset", &st::StragglerDetector::reset);
}

}  // namespace resilient::py
