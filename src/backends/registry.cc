#include "backends/registry.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace hearth {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<BackendKind>, std::less<>> kinds;
};

// Built-in kinds are registered on first use, so that nothing depends on
// the order of static initialisers.
void RegisterBuiltins(Registry& r);

Registry& Get() {
  static Registry* registry = [] {
    auto* r = new Registry;  // lives until exit: kinds may be looked up from any thread
    RegisterBuiltins(*r);
    return r;
  }();
  return *registry;
}

Status Add(Registry& r, BackendKind kind) {
  if (kind.name.empty()) return InvalidArgument("a backend kind needs a name");
  if (!kind.create && !kind.create_engine && !kind.program)
    return InvalidArgument("backend kind '" + kind.name +
                           "' has neither create, create_engine nor program");
  if (kind.program && (kind.create || kind.create_engine))
    return InvalidArgument("backend kind '" + kind.name +
                           "' is a program and is built in this process: one or the other");
  std::lock_guard lock(r.mu);
  if (r.kinds.count(kind.name))
    return InvalidArgument("backend kind '" + kind.name + "' is registered twice");
  std::string name = kind.name;
  r.kinds.emplace(std::move(name), std::make_unique<BackendKind>(std::move(kind)));
  return Status::Ok();
}

}  // namespace

// Defined in builtin_backends.cc.
std::vector<BackendKind> BuiltinBackendKinds();

namespace {
void RegisterBuiltins(Registry& r) {
  for (BackendKind& k : BuiltinBackendKinds()) (void)Add(r, std::move(k));
}
}  // namespace

Status RegisterBackendKind(BackendKind kind) { return Add(Get(), std::move(kind)); }

const BackendKind* FindBackendKind(std::string_view name) {
  Registry& r = Get();
  std::lock_guard lock(r.mu);
  auto it = r.kinds.find(name);
  return it == r.kinds.end() ? nullptr : it->second.get();
}

std::vector<std::string> BackendKindNames() {
  Registry& r = Get();
  std::lock_guard lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, kind] : r.kinds) names.push_back(name);
  return names;
}

Status UnknownBackendKind(std::string_view name) {
  std::string known;
  for (const std::string& n : BackendKindNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown backend kind '" + std::string(name) + "' (known: " + known + ")");
}

}  // namespace hearth
