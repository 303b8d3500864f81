#pragma once
// A scriptable fake NCCL function table for CPU tests of the communicator manager. NCCL entry
// points are plain C function pointers, so the fake's state is one global (FakeNccl::current),
// installed by the fixture. Communicators are FakeComm objects owned by the fake.

#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "resilient/comm/nccl_api.hpp"

namespace resilient::comm::testing {

struct FakeComm {
  int rank = 0;
  int size = 0;
  std::string id;
  int pending_polls = 0;     // polls that still report ncclInProgress; -1 = forever
  int async = kNcclSuccess;  // reported once no longer pending
  bool aborted = false;
  bool destroyed = false;
  bool revoked = false;
  int shrink_flags = -1;
  std::vector<int> excluded;
  // A shrink in flight on this (parent) communicator. As in NCCL 2.28, the child is written
  // through the caller's pointer only when its init ends, which polls of the parent advance;
  // a child whose init failed is published too, carrying the error, and aborting the parent
  // ends the init (the child is published then, failed). Meanwhile the parent reports
  // ncclInProgress.
  FakeComm* pending_child = nullptr;
  NcclComm* publish_to = nullptr;
  int child_polls = 0;
  int child_async = kNcclSuccess;
};

struct FakeNccl {
  // Script.
  int version = nccl_version_code(2, 28, 9);
  bool has_revoke = true;
  bool has_shrink = true;
  int init_polls = 2;  // -1: init never completes
  int init_rc = kNcclInProgress;
  int shrink_polls = 1;             // polls of the parent until the child is published; -1: never
  int shrink_async = kNcclSuccess;  // a second failure during the shrink
  int shrink_rc = kNcclInProgress;  // NCCL 2.28.9 was seen to return ncclSuccess here
  int revoke_polls = 1;             // -1: the revoked comm never quiesces
  int async_after_revoke = kNcclSuccess;
  int collective_rc = kNcclSuccess;
  // Observations.
  int unique_ids = 0, inits = 0, aborts = 0, destroys = 0, revokes = 0, shrinks = 0,
      all_reduces = 0, broadcasts = 0, polls = 0, use_after_free = 0;
  int last_blocking = -2;
  unsigned int last_config_version = 0;
  std::deque<std::unique_ptr<FakeComm>> comms;

  static FakeNccl*& current() {
    static FakeNccl* f = nullptr;
    return f;
  }
  static FakeComm* of(NcclComm c) { return reinterpret_cast<FakeComm*>(c); }
  static NcclComm handle(FakeComm* c) { return reinterpret_cast<NcclComm>(c); }

  NcclApi table() const;
};

namespace detail {
inline FakeNccl& g() { return *FakeNccl::current(); }
inline int get_version(int* v) {
  *v = g().version;
  return kNcclSuccess;
}
inline int get_unique_id(NcclUniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  std::string s = "fake-id-" + std::to_string(++g().unique_ids);
  std::memcpy(id->internal, s.data(), s.size());
  return kNcclSuccess;
}
inline int init(NcclComm* comm, int nranks, NcclUniqueId id, int rank, NcclConfig* config) {
  auto& f = g();
  ++f.inits;
  f.last_blocking = config->blocking;
  f.last_config_version = config->version;
  auto c = std::make_unique<FakeComm>();
  c->rank = rank;
  c->size = nranks;
  c->id = std::string(id.internal);
  c->pending_polls = f.init_polls;
  *comm = FakeNccl::handle(c.get());
  f.comms.push_back(std::move(c));
  return f.init_rc;
}
inline int get_async_error(NcclComm comm, int* err) {
  auto& f = g();
  ++f.polls;
  FakeComm* c = FakeNccl::of(comm);
  if (c->aborted || c->destroyed) {
    ++f.use_after_free;
    return kNcclInvalidUsage;
  }
  if (FakeComm* child = c->pending_child) {
    if (c->child_polls > 0) --c->child_polls;
    if (c->child_polls == 0) {
      c->pending_child = nullptr;
      child->async = c->child_async;
      *c->publish_to = FakeNccl::handle(child);
    }
    *err = kNcclInProgress;
    return kNcclSuccess;
  }
  if (c->pending_polls != 0) {
    if (c->pending_polls > 0) --c->pending_polls;
    *err = kNcclInProgress;
  } else {
    *err = c->async;
  }
  return kNcclSuccess;
}
inline int abort(NcclComm comm) {
  ++g().aborts;
  FakeComm* c = FakeNccl::of(comm);
  c->aborted = true;
  if (c->pending_child != nullptr) {  // aborting the parent ends the child's init, failed
    c->pending_child->async = kNcclInternalError;
    *c->publish_to = FakeNccl::handle(c->pending_child);
    c->pending_child = nullptr;
  }
  return kNcclSuccess;
}
inline int finalize(NcclComm) { return kNcclSuccess; }
inline int destroy(NcclComm comm) {
  ++g().destroys;
  FakeNccl::of(comm)->destroyed = true;
  return kNcclSuccess;
}
inline int count(NcclComm comm, int* n) {
  *n = FakeNccl::of(comm)->size;
  return kNcclSuccess;
}
inline int user_rank(NcclComm comm, int* r) {
  *r = FakeNccl::of(comm)->rank;
  return kNcclSuccess;
}
inline int all_reduce(const void*, void*, size_t, int, int, NcclComm, void*) {
  ++g().all_reduces;
  return g().collective_rc;
}
inline int broadcast(const void*, void*, size_t, int, int, NcclComm, void*) {
  ++g().broadcasts;
  return g().collective_rc;
}
inline const char* error_string(int rc) {
  switch (rc) {
    case kNcclRemoteError:
      return "remote process exited or there was a network error";
    case kNcclInProgress:
      return "operation in progress";
    default:
      return "fake NCCL error";
  }
}
inline const char* last_error(NcclComm) { return "fake last error"; }
inline int revoke(NcclComm comm, int) {
  ++g().revokes;
  FakeComm* c = FakeNccl::of(comm);
  c->revoked = true;
  c->pending_polls = g().revoke_polls;
  c->async = g().async_after_revoke;  // nccl.h: ncclSuccess once quiescent
  return kNcclSuccess;
}
inline int shrink(NcclComm comm, int* exclude, int n, NcclComm* newcomm, NcclConfig* config,
                  int flags) {
  auto& f = g();
  ++f.shrinks;
  f.last_blocking = config->blocking;
  FakeComm* parent = FakeNccl::of(comm);
  auto c = std::make_unique<FakeComm>();
  c->excluded.assign(exclude, exclude + n);
  int below = 0;
  for (int r : c->excluded) below += r < parent->rank ? 1 : 0;
  c->rank = parent->rank - below;
  c->size = parent->size - n;
  c->id = parent->id + "/shrunk";
  c->shrink_flags = flags;
  *newcomm = nullptr;
  parent->pending_child = c.get();
  parent->publish_to = newcomm;
  parent->child_polls = f.shrink_polls;
  parent->child_async = f.shrink_async;
  f.comms.push_back(std::move(c));
  return f.shrink_rc;
}
}  // namespace detail

inline NcclApi FakeNccl::table() const {
  NcclApi api;
  api.get_version = detail::get_version;
  api.get_unique_id = detail::get_unique_id;
  api.comm_init_rank_config = detail::init;
  api.comm_get_async_error = detail::get_async_error;
  api.comm_abort = detail::abort;
  api.comm_finalize = detail::finalize;
  api.comm_destroy = detail::destroy;
  api.comm_count = detail::count;
  api.comm_user_rank = detail::user_rank;
  api.all_reduce = detail::all_reduce;
  api.broadcast = detail::broadcast;
  api.get_error_string = detail::error_string;
  api.get_last_error = detail::last_error;
  if (has_revoke) api.comm_revoke = detail::revoke;
  if (has_shrink) api.comm_shrink = detail::shrink;
  return api;
}

}  // namespace resilient::comm::testing
