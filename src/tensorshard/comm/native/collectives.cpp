// tensorshard's native collectives: an all-reduce and an all-gather as torch operators implemented in C++, over
// a memory region that the ranks of a group share, so that a compiled graph calls them without entering Python.
//
//   tensorshard::native_all_reduce(Tensor x, int group, int rank, str where) -> Tensor
//       the sum of every rank's x, in rank order 0..N-1 (((x0 + x1) + x2) ...): the eager path's bits
//   tensorshard::native_all_gather(Tensor x, int group, int rank, int dim, int[] sizes, str where) -> Tensor
//       every rank's x concatenated along dim in rank order; rank r's piece has sizes[r] rows along dim
//   rank -1 in either: the calling thread's rank in that group (native_set_thread_rank); group -1: the group the
//       thread set last. Shards whose graphs differ only by their rank then run one compiled graph, and a graph
//       names no group (inductor's compile cache finds it again in another split model or process)
//   tensorshard::native_hold(Tensor[] xs) -> int / native_release(int) -> ()
//       one more C++ reference to each tensor until released: an inductor C++-wrapper graph that frees an input
//       after its last use then never drops the last C++ reference of a tensor Python owns (which takes the GIL)
//
//   tensorshard::native_group_broken(int group) -> int / native_group_reset(int group) -> ()
//       0, or 1 + the rank that marked the group failed / a failed group usable again, under the same handle
//       (only while no rank is inside one of its collectives: comm/recovery.py meets the ranks around it)
//
// A group is a handle (an int) naming a Region: a control area and two buffer sets of one slot per rank.
//   process flavour: the region is part of a shared-memory segment every rank (a process) has mapped
//                    (native_process_group: its address, size, this process's rank, the ranks' process ids)
//   thread flavour:  the region is heap memory of this process, each rank a thread (native_thread_group)
// Build and loading: comm/native/library.py; the Python API and why: comm/native/ops.py, docs/native.md.
//
// A round: rank r waits until every peer is done with the buffer set it is about to overwrite (the set of
// two rounds ago), copies its piece into its slot of the round's set, writes its header (what it is doing),
// then publishes the round's number in its `arrived` word (release). It waits for every peer's `arrived` to
// reach the round (acquire), compares the peers' headers with its own (ranks at different collectives fail
// here instead of mixing their data), reads every slot, and publishes the round in its `read` word.
// Waiting spins for a few microseconds, then yields the CPU, then sleeps in short naps (there may be more
// ranks than cores); it gives up after the group's timeout, when a peer process has ended, or when another
// rank marked the group failed, and then raises (a c10::Error, a RuntimeError in Python). A thread that holds
// Python's GIL releases it once its wait goes past the first spin.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <dlfcn.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint64_t kMagic = 0x74736e6174697665ULL;  // "tsnative"
constexpr int64_t kLine = 64;                         // one cache line
constexpr int64_t kLabel = 40;                        // bytes of a header's label
constexpr int64_t kReason = 448;                      // bytes of the failure reason

enum Kind : int64_t { kAllReduce = 1, kAllGather = 2 };

// --- the shared layout (the same in both flavours) ------------------------------------------------------

struct alignas(64) Control {
  std::atomic<uint64_t> magic;
  std::atomic<int64_t> broken;  // 0, or 1 + the rank that marked the group failed
  char reason[kReason];         // what it said (written before `broken` is set)
};

struct alignas(64) RankWords {
  std::atomic<uint64_t> arrived;  // the last round whose piece and header this rank has written
  char pad0[kLine - 8];
  std::atomic<uint64_t> read;     // the last round this rank has finished reading
  char pad1[kLine - 8];
};

struct alignas(64) Header {  // what a rank is doing in a round (one per buffer set and rank)
  int64_t kind, dtype, numel, extra;
  char label[kLine - 32];
};

int64_t region_bytes(int64_t world, int64_t slot) {
  return int64_t(sizeof(Control)) + world * int64_t(sizeof(RankWords)) + 2 * world * int64_t(sizeof(Header)) +
         2 * world * slot;
}

// --- Python's GIL, without Python's headers (resolved in the running process, absent outside Python) -----

struct Gil {
  int (*check)() = nullptr;
  void* (*save)() = nullptr;
  void (*restore)(void*) = nullptr;
  Gil() {
    check = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
    save = reinterpret_cast<void* (*)()>(dlsym(RTLD_DEFAULT, "PyEval_SaveThread"));
    restore = reinterpret_cast<void (*)(void*)>(dlsym(RTLD_DEFAULT, "PyEval_RestoreThread"));
    if (!check || !save || !restore) check = nullptr;
  }
};

const Gil& gil() {
  static Gil g;
  return g;
}

// Releases the GIL from the moment `release()` is called (if this thread holds it) until destruction.
class GilRelease {
 public:
  void release() {
    if (done_) return;
    done_ = true;
    const Gil& g = gil();
    if (g.check != nullptr && g.check()) state_ = g.save();
  }
  ~GilRelease() {
    if (state_ != nullptr) gil().restore(state_);
  }

 private:
  bool done_ = false;
  void* state_ = nullptr;
};

// --- counting (read by comm/counter.py through native_count_*) ------------------------------------------

std::atomic<int64_t> counting{0};
std::mutex count_mutex;
std::vector<std::string> count_log;  // "kind\tbytes\twhere"

void record(const char* kind, int64_t bytes, c10::string_view where) {
  if (counting.load(std::memory_order_relaxed) == 0) return;
  std::string line(kind);
  line += '\t';
  line += std::to_string(bytes);
  line += '\t';
  line.append(where.data(), where.size());
  std::lock_guard<std::mutex> lock(count_mutex);
  count_log.push_back(std::move(line));
}

// --- a group --------------------------------------------------------------------------------------------

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

bool process_alive(int64_t pid) {
  if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return true;
  char state = text[close + 2];
  return state != 'Z' && state != 'X';  // a zombie has ended
}

struct Group {
  char* base = nullptr;
  int64_t world = 0, slot = 0;
  double timeout = 300;
  std::vector<int64_t> pids;      // process flavour: every rank's process id; empty for threads
  int64_t owner = -1;             // process flavour: this process's rank; -1: threads (any rank)
  std::unique_ptr<char[]> heap;   // thread flavour: the region itself
  std::vector<uint64_t> rounds;   // per rank: the rounds it has run (each rank's own, kept here)

  Control* control() const { return reinterpret_cast<Control*>(base); }
  RankWords* words(int64_t r) const {
    return reinterpret_cast<RankWords*>(base + sizeof(Control)) + r;
  }
  Header* header(int64_t set, int64_t r) const {
    return reinterpret_cast<Header*>(base + sizeof(Control) + world * sizeof(RankWords)) + set * world + r;
  }
  char* slot_of(int64_t set, int64_t r) const {
    return base + sizeof(Control) + world * sizeof(RankWords) + 2 * world * sizeof(Header) + (set * world + r) * slot;
  }
  bool counts_for(int64_t rank) const { return owner >= 0 || rank == 0; }  // threads: counted once
};

std::shared_mutex groups_mutex;
std::unordered_map<int64_t, std::shared_ptr<Group>> groups;
int64_t next_handle = 1;

std::shared_ptr<Group> group_of(int64_t handle) {
  std::shared_lock<std::shared_mutex> lock(groups_mutex);
  auto it = groups.find(handle);
  TORCH_CHECK(it != groups.end(), "tensorshard native collective: no group ", handle,
              " in this process (it was closed, or the compiled graph belongs to another split model: compile "
              "the model's step again)");
  return it->second;
}

int64_t add_group(std::shared_ptr<Group> g) {
  std::unique_lock<std::shared_mutex> lock(groups_mutex);
  int64_t handle = next_handle++;
  groups[handle] = std::move(g);
  return handle;
}

std::string describe(const Header& h) {
  static const char* dtypes[] = {"uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"};
  std::ostringstream out;
  out << (h.kind == kAllReduce ? "all_reduce" : h.kind == kAllGather ? "all_gather" : "?") << " '"
      << std::string(h.label, strnlen(h.label, sizeof(h.label))) << "' (" << h.numel << " ";
  if (h.dtype >= 0 && h.dtype < 8) out << dtypes[h.dtype];
  else out << "dtype " << h.dtype;
  out << ")";
  return out.str();
}

[[noreturn]] void fail(Group& g, int64_t rank, const std::string& what) {
  Control* c = g.control();
  int64_t expected = 0;
  std::string message = what;
  // First failure wins: its reason is what every other rank reports.
  if (c->broken.load(std::memory_order_acquire) == 0) {
    std::snprintf(c->reason, kReason, "%s", what.c_str());
    c->broken.compare_exchange_strong(expected, rank + 1, std::memory_order_acq_rel);
  }
  TORCH_CHECK(false, message);
}

[[noreturn]] void fail_broken(Group& g, int64_t rank, const char* doing) {
  Control* c = g.control();
  int64_t who = c->broken.load(std::memory_order_acquire) - 1;
  std::string reason(c->reason, strnlen(c->reason, kReason));
  TORCH_CHECK(false, "tensorshard native collective ", doing, " on rank ", rank, " of ", g.world,
              ": the group failed on rank ", who, " before (", reason, "); it serves no collective until every ",
              "rank has left that failure and the ranks restore it together (the torchrun engine does at the next ",
              "compiled decode call or parallelize, where the ranks failed together; otherwise they are out of ",
              "step: end the job)");
}

// Waits until every peer's word (arrived or read, chosen by `which`) reaches `round`.
void wait_for(Group& g, int64_t rank, uint64_t round, bool arrived, const char* doing, GilRelease& unlocked) {
  auto reached = [&](int64_t r) {
    RankWords* w = g.words(r);
    return (arrived ? w->arrived : w->read).load(std::memory_order_acquire) >= round;
  };
  auto all = [&]() {
    for (int64_t r = 0; r < g.world; ++r)
      if (r != rank && !reached(r)) return false;
    return true;
  };
  for (int i = 0; i < 256; ++i) {  // a few microseconds: a peer that is nearly there
    if (all()) return;
    cpu_relax();
  }
  unlocked.release();
  double began = now(), checked = began;
  int64_t turns = 0;
  while (!all()) {
    if (g.control()->broken.load(std::memory_order_acquire) != 0) fail_broken(g, rank, doing);
    ++turns;
    if (turns < 2000) {
      sched_yield();  // more ranks than cores: let a peer run
    } else {
      struct timespec nap = {0, 50000};  // 50 us
      nanosleep(&nap, nullptr);
    }
    if ((turns & 63) != 0) continue;
    double t = now();
    if (t - checked > 0.1 && !g.pids.empty()) {
      checked = t;
      for (int64_t r = 0; r < g.world; ++r)
        if (r != rank && !reached(r) && !process_alive(g.pids[r]))
          fail(g, rank, std::string("tensorshard native collective: rank ") + std::to_string(r) + " (process " + std::to_string(g.pids[r]) +
                            ") ended while rank " + std::to_string(rank) + " waited for it at " + doing);
    }
    if (t - began > g.timeout) {
      std::ostringstream missing;
      for (int64_t r = 0; r < g.world; ++r)
        if (r != rank && !reached(r)) missing << " " << r;
      char seconds[32];
      std::snprintf(seconds, sizeof(seconds), "%.3g", t - began);
      fail(g, rank, std::string("tensorshard native collective: rank ") + std::to_string(rank) + " timed out after " + seconds + " s at " + doing +
                        " waiting for rank(s)" + missing.str() +
                        " (they did not reach this collective: stuck, or running other code)");
    }
  }
}

int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kByte: return 0;
    case at::kChar: return 1;
    case at::kShort: return 2;
    case at::kInt: return 3;
    case at::kLong: return 4;
    case at::kHalf: return 5;
    case at::kFloat: return 6;
    case at::kDouble: return 7;
    default: return 100 + int64_t(t);
  }
}

// One round: publish `bytes` of `piece` with its header, meet, check headers; then `use` reads the slots.
template <typename Use>
void round_trip(Group& g, int64_t rank, const Header& mine, const char* piece, int64_t bytes, const char* doing,
                GilRelease& unlocked, Use use) {
  uint64_t round = ++g.rounds[rank];
  int64_t set = int64_t(round & 1);
  if (round > 2) wait_for(g, rank, round - 2, false, doing, unlocked);  // peers done with this set
  if (g.control()->broken.load(std::memory_order_acquire) != 0) fail_broken(g, rank, doing);
  if (bytes > 0) std::memcpy(g.slot_of(set, rank), piece, size_t(bytes));
  *g.header(set, rank) = mine;
  g.words(rank)->arrived.store(round, std::memory_order_release);
  wait_for(g, rank, round, true, doing, unlocked);
  for (int64_t r = 0; r < g.world; ++r) {
    const Header& h = *g.header(set, r);
    if (r != rank && (h.kind != mine.kind || h.dtype != mine.dtype || h.numel != mine.numel || h.extra != mine.extra)) {
      std::ostringstream out;
      out << "tensorshard native collective: the ranks are at different collectives (rank " << rank << " at "
          << describe(mine) << ", rank " << r << " at " << describe(h) << ")";
      fail(g, rank, out.str());
    }
  }
  use(set);
  g.words(rank)->read.store(round, std::memory_order_release);
}

Header header_for(int64_t kind, const at::Tensor& x, int64_t numel, int64_t extra, c10::string_view where) {
  Header h{};
  h.kind = kind;
  h.dtype = dtype_code(x.scalar_type());
  h.numel = numel;
  h.extra = extra;
  size_t n = std::min(where.size(), sizeof(h.label) - 1);
  std::memcpy(h.label, where.data(), n);
  return h;
}

std::string doing_text(const char* kind, c10::string_view where) {
  return std::string(kind) + " '" + std::string(where.data(), where.size()) + "'";
}

void check_call(const Group& g, int64_t rank, const at::Tensor& x, const char* kind) {
  TORCH_CHECK(rank >= 0 && rank < g.world, "tensorshard native ", kind, ": rank ", rank, " is not in a group of ",
              g.world, " ranks");
  TORCH_CHECK(g.owner < 0 || g.owner == rank, "tensorshard native ", kind, ": this process is rank ", g.owner,
              " of its group, called as rank ", rank);
  TORCH_CHECK(x.device().is_cpu(), "tensorshard native ", kind, ": the tensor is on ", x.device(),
              "; these collectives run on CPU tensors only");
  TORCH_CHECK(x.scalar_type() != at::kBool && !x.is_complex(), "tensorshard native ", kind, ": dtype ",
              x.scalar_type(), " is not supported (floating point and integer tensors are)");
}

// --- the calling thread's rank (rank -1 in an operator) -------------------------------------------------

thread_local std::vector<std::pair<int64_t, int64_t>> thread_ranks;  // (group, rank) pairs this thread set
thread_local int64_t thread_group = -1;                               // the group this thread set last

int64_t group_here(int64_t handle, const char* kind) {
  if (handle >= 0) return handle;
  TORCH_CHECK(thread_group >= 0, "tensorshard native ", kind, ": called with group -1 (this thread's group), but ",
              "this thread never set one (native_set_thread_rank(group, rank) first)");
  return thread_group;
}

int64_t rank_of(int64_t handle, int64_t rank, const char* kind) {
  if (rank >= 0) return rank;
  for (const auto& gr : thread_ranks)
    if (gr.first == handle) return gr.second;
  TORCH_CHECK(false, "tensorshard native ", kind, ": called with rank -1 (this thread's rank) in group ", handle,
              ", but this thread never set its rank there (native_set_thread_rank(group, rank) first)");
}

void native_set_thread_rank(int64_t handle, int64_t rank) {
  thread_group = handle;
  for (auto& gr : thread_ranks)
    if (gr.first == handle) {
      gr.second = rank;
      return;
    }
  thread_ranks.emplace_back(handle, rank);
}

// --- held references (native_hold / native_release) ------------------------------------------------------

std::mutex holds_mutex;
std::unordered_map<int64_t, std::vector<at::Tensor>> holds;
int64_t next_hold = 1;

int64_t native_hold(at::TensorList xs) {
  std::vector<at::Tensor> kept(xs.begin(), xs.end());
  std::lock_guard<std::mutex> lock(holds_mutex);
  int64_t id = next_hold++;
  holds.emplace(id, std::move(kept));
  return id;
}

void native_release(int64_t id) {
  std::vector<at::Tensor> dropped;  // dropped after the lock (the caller holds the GIL: a last reference may need it)
  {
    std::lock_guard<std::mutex> lock(holds_mutex);
    auto it = holds.find(id);
    if (it == holds.end()) return;
    dropped = std::move(it->second);
    holds.erase(it);
  }
}

// --- the operators --------------------------------------------------------------------------------------

at::Tensor native_all_reduce(const at::Tensor& input, int64_t handle, int64_t rank, c10::string_view where) {
  handle = group_here(handle, "all_reduce");
  std::shared_ptr<Group> gp = group_of(handle);
  Group& g = *gp;
  rank = rank_of(handle, rank, "all_reduce");
  check_call(g, rank, input, "all_reduce");
  at::Tensor x = input.contiguous();
  at::Tensor out = x.new_empty(x.sizes());
  const int64_t es = x.element_size(), n = x.numel();
  Header mine = header_for(kAllReduce, x, n, 0, where);
  std::string doing = doing_text("all_reduce", where);
  GilRelease unlocked;
  const int64_t per_round = g.slot / es;
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  for (int64_t start = 0; start < n || (n == 0 && start == 0); start += per_round) {
    int64_t count = std::min(per_round, n - start);
    round_trip(g, rank, mine, src + start * es, count * es, doing.c_str(), unlocked, [&](int64_t set) {
      AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "native_all_reduce", [&] {
        scalar_t* o = reinterpret_cast<scalar_t*>(dst) + start;
        const scalar_t* a = reinterpret_cast<const scalar_t*>(g.slot_of(set, 0));
        const scalar_t* b = reinterpret_cast<const scalar_t*>(g.slot_of(set, 1));
        for (int64_t i = 0; i < count; ++i) o[i] = static_cast<scalar_t>(a[i] + b[i]);
        for (int64_t r = 2; r < g.world; ++r) {
          const scalar_t* c = reinterpret_cast<const scalar_t*>(g.slot_of(set, r));
          for (int64_t i = 0; i < count; ++i) o[i] = static_cast<scalar_t>(o[i] + c[i]);
        }
      });
    });
    if (n == 0) break;
  }
  if (g.counts_for(rank)) record("all_reduce", n * es, where);
  return out;
}

at::Tensor native_all_gather(const at::Tensor& input, int64_t handle, int64_t rank, int64_t dim,
                             c10::IntArrayRef sizes, c10::string_view where) {
  handle = group_here(handle, "all_gather");
  std::shared_ptr<Group> gp = group_of(handle);
  Group& g = *gp;
  rank = rank_of(handle, rank, "all_gather");
  check_call(g, rank, input, "all_gather");
  TORCH_CHECK(int64_t(sizes.size()) == g.world, "tensorshard native all_gather: ", sizes.size(),
              " sizes for a group of ", g.world, " ranks");
  if (dim < 0) dim += input.dim();
  TORCH_CHECK(dim >= 0 && dim < input.dim(), "tensorshard native all_gather: dim ", dim, " of a ", input.dim(),
              "-d tensor");
  TORCH_CHECK(input.size(dim) == sizes[rank], "tensorshard native all_gather: rank ", rank, "'s piece has ",
              input.size(dim), " rows along dim ", dim, ", its size says ", sizes[rank]);
  at::Tensor x = input.contiguous();
  const int64_t es = x.element_size();
  int64_t outer = 1, inner = 1, total = 0, longest = 0;
  for (int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
  for (int64_t s : sizes) total += s, longest = std::max(longest, s);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[dim] = total;
  at::Tensor out = x.new_empty(shape);
  Header mine = header_for(kAllGather, x, outer * total * inner, dim, where);
  std::string doing = doing_text("all_gather", where);
  GilRelease unlocked;
  // Rank r's piece, flat: outer rows of sizes[r] * inner elements; at offset(r) * inner within each output row.
  const int64_t row_out = total * inner * es;
  std::vector<int64_t> offset(g.world, 0);
  for (int64_t r = 1; r < g.world; ++r) offset[r] = offset[r - 1] + sizes[r - 1];
  const int64_t piece_max = outer * longest * inner * es;
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.mutable_data_ptr());
  const int64_t mine_bytes = outer * sizes[rank] * inner * es;
  for (int64_t start = 0; start < piece_max || (piece_max == 0 && start == 0); start += g.slot) {
    int64_t count = std::max<int64_t>(0, std::min(g.slot, mine_bytes - start));
    round_trip(g, rank, mine, src + start, count, doing.c_str(), unlocked, [&](int64_t set) {
      for (int64_t r = 0; r < g.world; ++r) {
        const int64_t row_in = sizes[r] * inner * es, bytes = outer * row_in;
        if (row_in == 0) continue;
        const char* from = g.slot_of(set, r);
        // bytes [start, end) of rank r's piece are in its slot: copy them row by row into place
        for (int64_t at_ = start, end = std::min(bytes, start + g.slot); at_ < end;) {
          int64_t row = at_ / row_in, col = at_ % row_in;
          int64_t len = std::min(row_in - col, end - at_);
          std::memcpy(dst + row * row_out + offset[r] * inner * es + col, from + (at_ - start), size_t(len));
          at_ += len;
        }
      }
    });
    if (piece_max == 0) break;
  }
  if (g.counts_for(rank)) record("all_gather", outer * total * inner * es, where);
  return out;
}

// --- groups ---------------------------------------------------------------------------------------------

int64_t slot_for(int64_t nbytes, int64_t world) {
  int64_t fixed = region_bytes(world, 0);
  int64_t slot = (nbytes - fixed) / (2 * world) / kLine * kLine;
  return slot;
}

int64_t native_region_bytes(int64_t world, int64_t slot) { return region_bytes(world, slot); }

int64_t native_process_group(int64_t address, int64_t nbytes, int64_t rank, int64_t world, double timeout,
                             c10::IntArrayRef pids) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "native_process_group: rank ", rank, " of ", world);
  TORCH_CHECK(int64_t(pids.size()) == world, "native_process_group: ", pids.size(), " process ids for ", world,
              " ranks");
  TORCH_CHECK(address % kLine == 0, "native_process_group: the region must be 64-byte aligned");
  auto g = std::make_shared<Group>();
  g->base = reinterpret_cast<char*>(address);
  g->world = world;
  g->slot = slot_for(nbytes, world);
  TORCH_CHECK(g->slot >= 4096, "native_process_group: a region of ", nbytes, " bytes is too small for ", world,
              " ranks");
  g->timeout = timeout;
  g->pids.assign(pids.begin(), pids.end());
  g->owner = rank;
  g->rounds.assign(world, 0);
  // The segment is fresh (zero); every rank writes the same magic.
  g->control()->magic.store(kMagic, std::memory_order_release);
  return add_group(std::move(g));
}

int64_t native_thread_group(int64_t world, int64_t slot, double timeout) {
  TORCH_CHECK(world >= 1, "native_thread_group: a group needs at least one rank, got ", world);
  TORCH_CHECK(slot >= 4096 && slot % kLine == 0, "native_thread_group: slot of ", slot,
              " bytes (at least 4096, a multiple of 64)");
  auto g = std::make_shared<Group>();
  int64_t bytes = region_bytes(world, slot);
  g->heap.reset(new char[bytes + kLine]);
  uintptr_t p = reinterpret_cast<uintptr_t>(g->heap.get());
  g->base = reinterpret_cast<char*>((p + kLine - 1) / kLine * kLine);
  std::memset(g->base, 0, size_t(bytes));
  g->world = world;
  g->slot = slot;
  g->timeout = timeout;
  g->rounds.assign(world, 0);
  g->control()->magic.store(kMagic, std::memory_order_release);
  return add_group(std::move(g));
}

void native_group_abort(int64_t handle, int64_t rank, c10::string_view reason) {
  std::shared_ptr<Group> g;
  {
    std::shared_lock<std::shared_mutex> lock(groups_mutex);
    auto it = groups.find(handle);
    if (it == groups.end()) return;
    g = it->second;
  }
  Control* c = g->control();
  if (c->broken.load(std::memory_order_acquire) != 0) return;
  std::snprintf(c->reason, kReason, "%.*s", int(reason.size()), reason.data());
  int64_t expected = 0;
  c->broken.compare_exchange_strong(expected, rank + 1, std::memory_order_acq_rel);
}

// 0, or 1 + the rank that marked group `handle` failed.
int64_t native_group_broken(int64_t handle) {
  return group_of(handle)->control()->broken.load(std::memory_order_acquire);
}

// Makes a failed group serve collectives again, under the same handle (compiled graphs naming it stay valid). Only
// between two meetings of all its ranks, none inside a collective of the group (comm/recovery.py): this process's
// round counts start again from 0; rank 0 of a process group (any caller of a thread group) clears the shared words.
void native_group_reset(int64_t handle) {
  std::shared_ptr<Group> gp = group_of(handle);
  Group& g = *gp;
  std::fill(g.rounds.begin(), g.rounds.end(), uint64_t(0));
  if (g.owner > 0) return;
  for (int64_t r = 0; r < g.world; ++r) {
    g.words(r)->arrived.store(0, std::memory_order_relaxed);
    g.words(r)->read.store(0, std::memory_order_relaxed);
  }
  std::memset(static_cast<void*>(g.header(0, 0)), 0, size_t(2 * g.world) * sizeof(Header));
  std::memset(g.control()->reason, 0, kReason);
  g.control()->broken.store(0, std::memory_order_release);
}

void native_group_close(int64_t handle) {
  std::unique_lock<std::shared_mutex> lock(groups_mutex);
  groups.erase(handle);
}

int64_t native_count_start() {
  std::lock_guard<std::mutex> lock(count_mutex);
  counting.fetch_add(1);
  return int64_t(count_log.size());
}

std::string native_count_read(int64_t since) {
  std::lock_guard<std::mutex> lock(count_mutex);
  std::string out;
  for (size_t i = size_t(std::max<int64_t>(since, 0)); i < count_log.size(); ++i) {
    out += count_log[i];
    out += '\n';
  }
  return out;
}

void native_count_stop() {
  std::lock_guard<std::mutex> lock(count_mutex);
  if (counting.fetch_sub(1) == 1) count_log.clear();
}

int64_t native_count_position() {
  std::lock_guard<std::mutex> lock(count_mutex);
  return int64_t(count_log.size());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tensorshard, m) {
  m.def("native_all_reduce(Tensor x, int group, int rank, str where) -> Tensor");
  m.def("native_all_gather(Tensor x, int group, int rank, int dim, int[] sizes, str where) -> Tensor");
  m.def("native_region_bytes(int world, int slot) -> int", native_region_bytes);
  m.def("native_process_group(int address, int nbytes, int rank, int world, float timeout, int[] pids) -> int",
        native_process_group);
  m.def("native_thread_group(int world, int slot, float timeout) -> int", native_thread_group);
  m.def("native_group_abort(int group, int rank, str reason) -> ()", native_group_abort);
  m.def("native_group_broken(int group) -> int", native_group_broken);
  m.def("native_group_reset(int group) -> ()", native_group_reset);
  m.def("native_group_close(int group) -> ()", native_group_close);
  m.def("native_set_thread_rank(int group, int rank) -> ()", native_set_thread_rank);
  m.def("native_hold(Tensor[] xs) -> int", native_hold);
  m.def("native_release(int hold) -> ()", native_release);
  m.def("native_count_start() -> int", native_count_start);
  m.def("native_count_read(int since) -> str", native_count_read);
  m.def("native_count_stop() -> ()", native_count_stop);
  m.def("native_count_position() -> int", native_count_position);
}

TORCH_LIBRARY_IMPL(tensorshard, CPU, m) {
  m.impl("native_all_reduce", native_all_reduce);
  m.impl("native_all_gather", native_all_gather);
}
