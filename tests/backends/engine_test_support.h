// What the engine tests share: a ResponseSink that records what a worker
// would send, and a count request (the "count" engine's input) with the
// views an EngineRequest takes.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "backends/engine.h"

namespace hearth::testing {

// What a worker would send: per request, the numbers of its responses and
// whether the last was final or an error.
class RecordingSink final : public ResponseSink {
 public:
  struct Stream {
    std::vector<int64_t> numbers;
    std::vector<std::vector<int64_t>> shapes;
    bool final = false;
    Status error = Status::Ok();
  };

  Result<std::byte*> Output(uint64_t id, size_t i, std::span<const int64_t> shape,
                            uint64_t bytes) override {
    EXPECT_EQ(i, 0u);
    EXPECT_EQ(bytes, sizeof(int64_t));
    EXPECT_FALSE(streams[id].final) << "output after the final response of " << id;
    streams[id].shapes.emplace_back(shape.begin(), shape.end());
    building = id;
    return reinterpret_cast<std::byte*>(&room);
  }
  Result<bool> End(uint64_t id, bool final, const Status& status) override {
    Stream& s = streams[id];
    if (closed.count(id) != 0) return false;
    if (building == id) s.numbers.push_back(room);
    building = 0;
    s.final = final || !status.ok();
    s.error = status;
    ++responses;
    return true;
  }

  std::map<uint64_t, Stream> streams;
  std::map<uint64_t, bool> closed;  // ids the worker no longer holds (End says false)
  uint64_t building = 0;
  int64_t room = 0;
  int responses = 0;
};

struct CountRequest {
  int64_t n;
  std::vector<int64_t> shape = {1};
  std::vector<EngineInput> inputs;
  std::string parameters;
  std::vector<int64_t> resume;

  explicit CountRequest(int64_t count, std::string params = "", std::vector<int64_t> tokens = {})
      : n(count), parameters(std::move(params)), resume(std::move(tokens)) {}
  EngineRequest view() {
    inputs = {{std::as_bytes(std::span<const int64_t>(&n, 1)), shape}};
    return {inputs, parameters, resume};
  }
};

}  // namespace hearth::testing
