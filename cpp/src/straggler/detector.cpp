#include "resilient/straggler/detector.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <utility>

namespace resilient::straggler {
namespace {

bool phase_slow(double ratio, double z, double excess_s, double median_step_s,
                const StragglerOptions& o) {
  if (!std::isfinite(ratio)) return false;
  if (std::isfinite(median_step_s) && excess_s < o.min_step_fraction * median_step_s) return false;
  return ratio >= o.slow_ratio || (z >= o.z_threshold && ratio >= o.min_ratio);
}

// Values of one phase (or the step time when phase < 0) of the ranks that are scored.
std::vector<double> column(const WindowInput& in, int phase) {
  std::vector<double> out(in.ranks.size(), kNotMeasured);
  for (size_t r = 0; r < in.ranks.size(); ++r) {
    const RankWindow& w = in.ranks[r];
    if (w.steps <= 0) continue;
    out[r] = phase < 0 ? w.step_s : w.phase_s[phase];
  }
  return out;
}

// Slow phases first; among them the directly measured ones (compute, host) before the wait
// phase, whose implied ratio is only corroborating; then the largest ratio. Among phases that
// are not slow, the largest z.
void pick_worst(RankScore& s) {
  auto rank_of = [&](int p) {
    const PhaseScore& ps = s.phases[p];
    const bool direct = static_cast<Phase>(p) != Phase::kWait;
    return std::make_tuple(ps.slow, ps.slow && direct, ps.slow ? ps.ratio : ps.z);
  };
  int worst = -1;
  for (int p = 0; p < kNumPhases; ++p) {
    if (!std::isfinite(s.phases[p].ratio)) continue;
    if (worst < 0 || rank_of(p) > rank_of(worst)) worst = p;
  }
  if (worst < 0) return;
  s.worst_phase = static_cast<Phase>(worst);
  s.ratio = s.phases[worst].ratio;
  s.z = s.phases[worst].z;
  s.slow = s.phases[worst].slow;
}

std::string format_ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g ms", seconds * 1e3);
  return buf;
}

}  // namespace

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kCompute:
      return "compute";
    case Phase::kHost:
      return "host";
    case Phase::kWait:
      return "wait";
  }
  return "?";
}

std::string StragglerReport::to_string() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "rank %d %s straggler: %s %.2fx median (z=%.1f, %s vs %s)", rank,
                persistent ? "persistent" : "transient", phase_name(phase), ratio, z,
                format_ms(value_s).c_str(), format_ms(median_s).c_str());
  std::string out = buf;
  if (std::isfinite(self_ratio)) {
    std::snprintf(buf, sizeof buf, ", %.2fx its own baseline", self_ratio);
    out += buf;
  }
  std::snprintf(buf, sizeof buf, ", since step %lld (%lld slow windows)",
                static_cast<long long>(since_step), static_cast<long long>(flagged_windows));
  return out + buf;
}

Result<std::vector<RankScore>> score_window(const WindowInput& input,
                                            const StragglerOptions& options) {
  if (input.ranks.empty()) return Status(StatusCode::kInvalidArgument, "window has no ranks");
  if (input.first_step > input.last_step) {
    return Status(StatusCode::kInvalidArgument, "window first_step > last_step");
  }
  const size_t n = input.ranks.size();
  std::vector<RankScore> scores(n);
  for (size_t r = 0; r < n; ++r) scores[r].rank = static_cast<int>(r);

  const std::vector<double> steps = column(input, -1);
  const double median_step = median(steps);
  for (int p = 0; p < kNumPhases; ++p) {
    const std::vector<double> values = column(input, p);
    const RobustSummary s = summarize(values);
    if (s.count < static_cast<size_t>(options.min_ranks)) continue;
    const bool wait = static_cast<Phase>(p) == Phase::kWait;
    // The wait phase is scored against the step time: its spread floor and its implied ratio.
    if (wait && !std::isfinite(median_step)) continue;
    const double scale = wait ? std::max(robust_scale(s, 0.0), options.mad_floor * median_step)
                              : robust_scale(s, options.mad_floor);
    for (size_t r = 0; r < n; ++r) {
      const double v = values[r];
      if (!std::isfinite(v)) continue;
      PhaseScore& ps = scores[r].phases[p];
      ps.value = v;
      ps.median = s.median;
      double excess = v - s.median;
      if (wait) {
        excess = s.median - v;
        ps.z = excess / scale;
        const double busy_median = median_step - s.median;
        ps.ratio = busy_median > 0 ? (median_step - v) / busy_median : kNotMeasured;
      } else {
        ps.z = robust_z(v, s, scale);
        ps.ratio = s.median > 0 ? v / s.median : kNotMeasured;
      }
      ps.slow = phase_slow(ps.ratio, ps.z, excess, median_step, options);
    }
  }
  // The wait phase only corroborates: a collective's own duration varies across ranks (by
  // milliseconds for gloo on a loaded host), and that noise lands in the wait deficit. So waiting
  // little makes a rank slow only on a z-score (not the ratio rule alone) and only when its host
  // time, where the busy-time difference shows directly, is at least min_ratio above the median.
  constexpr int kWait = static_cast<int>(Phase::kWait);
  constexpr int kHost = static_cast<int>(Phase::kHost);
  for (RankScore& sc : scores) {
    PhaseScore& w = sc.phases[kWait];
    if (!w.slow) continue;
    const double host_ratio = sc.phases[kHost].ratio;
    w.slow = w.z >= options.z_threshold && w.ratio >= options.min_ratio &&
             (!std::isfinite(host_ratio) || host_ratio >= options.min_ratio);
  }
  for (RankScore& s : scores) pick_worst(s);
  return scores;
}

StragglerDetector::StragglerDetector(const StragglerOptions& options, int world_size)
    : options_(options), world_size_(world_size) {
  reset();
}

Result<StragglerDetector> StragglerDetector::create(const StragglerOptions& options,
                                                    int world_size) {
  RESILIENT_RETURN_IF_ERROR(options.validate());
  if (world_size < 1) return Status(StatusCode::kInvalidArgument, "world_size must be >= 1");
  return StragglerDetector(options, world_size);
}

void StragglerDetector::reset() {
  windows_ = 0;
  last_step_ = -1;
  ranks_.clear();
  ranks_.resize(world_size_);
  for (RankState& rs : ranks_) {
    rs.baseline.assign(kNumPhases, RollingHistory(static_cast<size_t>(options_.history_windows)));
  }
}

const CusumState& StragglerDetector::cusum_state(int rank) const {
  RESILIENT_CHECK(rank >= 0 && rank < world_size_, "rank " << rank << " out of range");
  return ranks_[rank].cusum;
}

Result<WindowResult> StragglerDetector::update(const WindowInput& input) {
  if (static_cast<int>(input.ranks.size()) != world_size_) {
    return Status(StatusCode::kInvalidArgument, "window has " + std::to_string(input.ranks.size()) +
                                                    " ranks, detector expects " +
                                                    std::to_string(world_size_));
  }
  if (input.first_step <= last_step_) {
    return Status(StatusCode::kInvalidArgument,
                  "window starts at step " + std::to_string(input.first_step) +
                      ", not after the previous window's last step " + std::to_string(last_step_));
  }
  RESILIENT_ASSIGN_OR_RETURN(std::vector<RankScore> scores, score_window(input, options_));

  WindowResult out;
  out.window = windows_;
  out.first_step = input.first_step;
  out.last_step = input.last_step;
  const double log_min = std::log(options_.min_ratio);
  for (RankScore& s : scores) {
    RankState& rs = ranks_[s.rank];
    const int worst = static_cast<int>(s.worst_phase);
    const double base = rs.baseline[worst].median();
    const double value = s.phases[worst].value;
    if (std::isfinite(base) && base > 0 && std::isfinite(value)) {
      // For the wait phase less is slower, so invert to keep ">1 = slower".
      s.self_ratio =
          s.worst_phase == Phase::kWait ? (value > 0 ? base / value : kNotMeasured) : value / base;
    }
    for (int p = 0; p < kNumPhases; ++p) {
      if (!s.phases[p].slow) rs.baseline[p].push(s.phases[p].value);
    }
    s.evidence = s.slow ? std::log(s.ratio) / log_min : 0.0;
    const CusumEvent ev = cusum_update(rs.cusum, s.evidence, input.first_step, options_.cusum);
    s.cusum = rs.cusum.sum;
    s.persistent = rs.cusum.persistent;
    if (ev.became_persistent) out.newly_persistent.push_back(s.rank);
    if (ev.recovered) out.recovered.push_back(s.rank);
    rs.slow_streak = s.slow ? rs.slow_streak + 1 : 0;
    s.slow_streak = rs.slow_streak;
    // Report while slow: after report_after windows in a row, or at once when the excursion is
    // already persistent (an intermittent straggler). A persistent rank that looks normal again
    // is not reported; its scores show the CUSUM decaying until `recovered`.
    if (!s.slow || (!s.persistent && s.slow_streak < options_.report_after)) continue;
    StragglerReport rep;
    rep.rank = s.rank;
    rep.phase = s.worst_phase;
    rep.ratio = s.ratio;
    rep.z = s.z;
    rep.value_s = s.phases[worst].value;
    rep.median_s = s.phases[worst].median;
    rep.self_ratio = s.self_ratio;
    rep.since_step = rs.cusum.run_start >= 0 ? rs.cusum.run_start : input.first_step;
    rep.last_step = input.last_step;
    rep.persistent = s.persistent;
    rep.cusum = s.cusum;
    rep.flagged_windows = rs.cusum.run_start >= 0 ? rs.cusum.flagged_windows : s.slow_streak;
    rep.slow_streak = s.slow_streak;
    out.reports.push_back(rep);
  }
  out.scores = std::move(scores);
  last_step_ = input.last_step;
  ++windows_;
  return out;
}

}  // namespace resilient::straggler
