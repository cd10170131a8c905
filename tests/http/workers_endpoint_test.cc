// GET /v2/hearth/workers over real TCP on a fake service: the JSON of the
// service's worker processes, standbys and hot spares, which the reader of
// `hearth status --url` reads back as it was; and that reader's errors.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "http/http_server.h"
#include "http/workers_json.h"
#include "support/fake_service.h"

namespace hearth {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using testing::FakeService;
using testing::FakeSettings;

std::vector<ModelWorkers> TwoModels() {
  ModelWorkers hot;
  hot.name = "scale";
  hot.version = "3";
  hot.standby_mode = "hot";
  hot.standby_workers = 1;
  PlacementWorkers cpu;
  cpu.device = "cpu";
  cpu.workers = {{0, 4242, true, 2, 0}, {1, -1, false, 5, 0}};
  cpu.hot_spares = {{4343, 1 << 20, 2500}};
  PlacementWorkers gpu;
  gpu.device = "cuda:1";
  // On the GPU, what the driver accounts to each process besides.
  gpu.workers = {{2, 4444, true, 0, 64ull << 20, 3, 512ull << 20}};
  gpu.hot_spares = {{4545, 64ull << 20, 1200, 322ull << 20}};
  hot.placements = {cpu, gpu};
  ModelWorkers cold;
  cold.name = "text";
  cold.version = "1";
  cold.standby_mode = "cold";
  cold.standby_workers = 2;
  PlacementWorkers host;
  host.device = "cpu";
  host.workers = {{0, 5000, true, 0, 0}};
  host.standbys = {{5001}, {5002}};
  cold.placements = {host};
  return {hot, cold};
}

using Response = http::response<http::string_body>;

Response Send(uint16_t port, http::verb method, const std::string& target) {
  net::io_context io;
  tcp::socket socket(io);
  socket.connect(tcp::endpoint(net::ip::address_v4::loopback(), port));
  // A test that fails does so in 20 s, not by hanging.
  timeval tv{};
  tv.tv_sec = 20;
  EXPECT_EQ(::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
  http::request<http::string_body> request(method, target, 11);
  request.set(http::field::host, "localhost");
  request.prepare_payload();
  http::write(socket, request);
  beast::flat_buffer buffer;
  Response response;
  http::read(socket, buffer, response);
  return response;
}

class WorkersEndpointTest : public ::testing::Test {
 protected:
  void Start(FakeSettings settings) {
    service_ = std::make_unique<FakeService>(std::move(settings));
    HttpOptions options;
    options.port = 0;
    Result<std::unique_ptr<HttpServer>> created = HttpServer::Create(service_.get(), options);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    server_ = std::move(created).value();
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  uint16_t port() const { return server_->port(); }

  std::unique_ptr<FakeService> service_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(WorkersEndpointTest, AnswersTheServicesProcessesAsJson) {
  FakeSettings settings;
  settings.workers = TwoModels();
  Start(settings);
  Response r = Send(port(), http::verb::get, "/v2/hearth/workers");
  ASSERT_EQ(r.result_int(), 200) << r.body();
  EXPECT_EQ(r[http::field::content_type], "application/json");
  const json body = json::parse(r.body());
  ASSERT_EQ(body["models"].size(), 2u);
  const json& scale = body["models"][0];
  EXPECT_EQ(scale["name"], "scale");
  EXPECT_EQ(scale["version"], "3");
  EXPECT_EQ(scale["standby_mode"], "hot");
  EXPECT_EQ(scale["standby_workers"], 1);
  ASSERT_EQ(scale["placements"].size(), 2u);
  EXPECT_EQ(scale["placements"][0]["workers"][0],
            json::parse(R"({"index": 0, "pid": 4242, "ready": true, "restarts": 2,
                            "device_memory_bytes": 0, "driver_device_memory_bytes": null,
                            "streams": 0})"));
  EXPECT_EQ(scale["placements"][0]["workers"][1]["pid"], -1);
  EXPECT_EQ(scale["placements"][0]["standbys"], json::array());
  EXPECT_EQ(scale["placements"][1]["device"], "cuda:1");
  EXPECT_EQ(scale["placements"][1]["workers"][0]["streams"], 3);
  EXPECT_EQ(scale["placements"][1]["workers"][0]["driver_device_memory_bytes"], 536870912);
  EXPECT_EQ(scale["placements"][1]["hot_spares"][0],
            json::parse(R"({"pid": 4545, "device_memory_bytes": 67108864, "warm_up_us": 1200,
                            "driver_device_memory_bytes": 337641472})"));
  EXPECT_EQ(body["models"][1]["placements"][0]["standbys"],
            json::parse(R"([{"pid": 5001}, {"pid": 5002}])"));

  // What `hearth status --url` reads is what the service said.
  Result<std::vector<ModelWorkers>> read = ParseWorkersJson(r.body());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->size(), 2u);
  const std::vector<ModelWorkers> want = TwoModels();
  for (size_t m = 0; m < want.size(); ++m) {
    EXPECT_EQ((*read)[m].name, want[m].name);
    EXPECT_EQ((*read)[m].standby_mode, want[m].standby_mode);
    ASSERT_EQ((*read)[m].placements.size(), want[m].placements.size());
    for (size_t p = 0; p < want[m].placements.size(); ++p) {
      const PlacementWorkers& got = (*read)[m].placements[p];
      const PlacementWorkers& sent = want[m].placements[p];
      EXPECT_EQ(got.device, sent.device);
      ASSERT_EQ(got.workers.size(), sent.workers.size());
      for (size_t w = 0; w < sent.workers.size(); ++w) {
        EXPECT_EQ(got.workers[w].index, sent.workers[w].index);
        EXPECT_EQ(got.workers[w].pid, sent.workers[w].pid);
        EXPECT_EQ(got.workers[w].ready, sent.workers[w].ready);
        EXPECT_EQ(got.workers[w].restarts, sent.workers[w].restarts);
        EXPECT_EQ(got.workers[w].device_memory_bytes, sent.workers[w].device_memory_bytes);
        EXPECT_EQ(got.workers[w].driver_device_memory_bytes,
                  sent.workers[w].driver_device_memory_bytes);
      }
      ASSERT_EQ(got.standbys.size(), sent.standbys.size());
      for (size_t s = 0; s < sent.standbys.size(); ++s)
        EXPECT_EQ(got.standbys[s].pid, sent.standbys[s].pid);
      ASSERT_EQ(got.hot_spares.size(), sent.hot_spares.size());
      for (size_t s = 0; s < sent.hot_spares.size(); ++s) {
        EXPECT_EQ(got.hot_spares[s].pid, sent.hot_spares[s].pid);
        EXPECT_EQ(got.hot_spares[s].device_memory_bytes, sent.hot_spares[s].device_memory_bytes);
        EXPECT_EQ(got.hot_spares[s].warm_up_us, sent.hot_spares[s].warm_up_us);
        EXPECT_EQ(got.hot_spares[s].driver_device_memory_bytes,
                  sent.hot_spares[s].driver_device_memory_bytes);
      }
    }
  }

  Response post = Send(port(), http::verb::post, "/v2/hearth/workers");
  EXPECT_EQ(post.result_int(), 405);
  EXPECT_EQ(post[http::field::allow], "GET");
  EXPECT_EQ(Send(port(), http::verb::get, "/v2/hearth/work").result_int(), 404);
  EXPECT_EQ(Send(port(), http::verb::get, "/v2/hearth").result_int(), 404);
}

TEST_F(WorkersEndpointTest, NoModelsIsAnEmptyListAndNoProcessesIs501) {
  FakeSettings none;
  none.workers = std::vector<ModelWorkers>{};
  Start(none);
  Response empty = Send(port(), http::verb::get, "/v2/hearth/workers");
  ASSERT_EQ(empty.result_int(), 200) << empty.body();
  EXPECT_EQ(json::parse(empty.body()), json::parse(R"({"models": []})"));
  server_->Stop();
  server_.reset();

  Start(FakeSettings{});  // a service that has no worker processes to tell of
  Response r = Send(port(), http::verb::get, "/v2/hearth/workers");
  EXPECT_EQ(r.result_int(), 501);
  EXPECT_NE(r.body().find("no worker processes here"), std::string::npos) << r.body();
}

TEST(WorkersJson, TheReaderNamesWhatIsWrong) {
  struct Case {
    std::string text, expect;
  };
  const std::vector<Case> cases = {
      {"<html>", "the answer is not JSON"},
      {"[]", "the answer: not a JSON object"},
      {R"({"model": []})", "the answer.models: missing, or not a list"},
      {R"({"models": [{"name": "m"}]})", "models[0].version: missing"},
      {R"({"models": [{"name": 1, "version": "1"}]})", "models[0].name: not a string"},
      {R"({"models": [{"name": "m", "version": "1", "standby_mode": "hot",
           "standby_workers": 1, "placements": [{"device": "cpu", "workers": [{"index": 0,
           "pid": 7, "ready": "yes", "restarts": 0, "device_memory_bytes": 0}],
           "standbys": [], "hot_spares": []}]}]})",
       "models[0].placements[0].workers[0].ready: not a boolean"},
      {R"({"models": [{"name": "m", "version": "1", "standby_mode": "hot",
           "standby_workers": 1, "placements": [{"device": "cpu", "workers": [],
           "standbys": [], "hot_spares": [{"pid": 8, "device_memory_bytes": -1,
           "warm_up_us": 3}]}]}]})",
       "models[0].placements[0].hot_spares[0].device_memory_bytes: not a non-negative integer"},
      {R"({"models": [{"name": "m", "version": "1", "standby_mode": "hot",
           "standby_workers": 1, "placements": [{"device": "cuda:0", "workers": [{"index": 0,
           "pid": 7, "ready": true, "restarts": 0, "device_memory_bytes": 0,
           "driver_device_memory_bytes": "512 MiB"}], "standbys": [], "hot_spares": []}]}]})",
       "models[0].placements[0].workers[0].driver_device_memory_bytes: not a non-negative "
       "integer or null"},
  };
  for (const Case& c : cases) {
    Result<std::vector<ModelWorkers>> read = ParseWorkersJson(c.text);
    ASSERT_FALSE(read.ok()) << c.text;
    EXPECT_NE(read.status().message().find(c.expect), std::string::npos)
        << "got: " << read.status().message() << "\nwant: " << c.expect;
  }
  // A newer server's members are skipped.
  Result<std::vector<ModelWorkers>> newer = ParseWorkersJson(
      R"({"models": [{"name": "m", "version": "1", "standby_mode": "cold", "standby_workers": 0,
          "placements": [], "added_later": true}], "also": 1})");
  ASSERT_TRUE(newer.ok()) << newer.status().ToString();
  EXPECT_EQ((*newer)[0].name, "m");
  // An older server's answer has no driver figures: unknown.
  Result<std::vector<ModelWorkers>> older = ParseWorkersJson(
      R"({"models": [{"name": "m", "version": "1", "standby_mode": "hot", "standby_workers": 1,
          "placements": [{"device": "cuda:0", "workers": [{"index": 0, "pid": 7,
          "ready": true, "restarts": 0, "device_memory_bytes": 0}], "standbys": [],
          "hot_spares": [{"pid": 8, "device_memory_bytes": 5, "warm_up_us": 3}]}]}]})");
  ASSERT_TRUE(older.ok()) << older.status().ToString();
  EXPECT_EQ((*older)[0].placements[0].workers[0].driver_device_memory_bytes, std::nullopt);
  EXPECT_EQ((*older)[0].placements[0].hot_spares[0].driver_device_memory_bytes, std::nullopt);
}

}  // namespace
}  // namespace hearth
