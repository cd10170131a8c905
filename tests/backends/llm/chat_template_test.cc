// chat_template.h against Python's jinja2: the real chat templates of
// tests/data/llm/templates over conversations (cases.json, expected/*.txt)
// and one small template per language piece (language_cases.json), both
// written by make_expected.py with Debian's python3-jinja2 in transformers'
// environment. Then the parser's errors, every limit, and tokenizer_config.json.
#include "backends/llm/chat_template.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace hearth::llm {
namespace {

using Json = nlohmann::ordered_json;

const std::string kDir = HEARTH_TEMPLATES_DIR;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The clock make_expected.py gives strftime_now: 2025-03-09 14:30:00.
std::tm FixedNow() {
  std::tm tm{};
  tm.tm_year = 2025 - 1900;
  tm.tm_mon = 2;
  tm.tm_mday = 9;
  tm.tm_hour = 14;
  tm.tm_min = 30;
  const time_t t = timegm(&tm);
  gmtime_r(&t, &tm);
  return tm;
}

ChatTemplateOptions FixedClock() {
  ChatTemplateOptions options;
  options.now = FixedNow;
  return options;
}

struct JinjaCase {
  std::string name;
  Json entry;
};
// How gtest (and ctest's list) names a case: by its name, not its bytes.
void PrintTo(const JinjaCase& c, std::ostream* os) { *os << c.name; }

std::vector<JinjaCase> LoadCases(const std::string& file) {
  std::vector<JinjaCase> cases;
  std::ifstream in(kDir + "/" + file);
  if (!in) return cases;
  const Json all = Json::parse(in);
  for (const Json& entry : all) {
    std::string name = entry["name"].get<std::string>();
    for (char& c : name) {
      if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    }
    cases.push_back({name, entry});
  }
  return cases;
}

// The render matches jinja2's: the same bytes, or the same error. An error
// raise_exception raises keeps its message exactly; jinja2's runtime errors
// appear after "chat template line N: ".
void ExpectSameAsJinja(const Result<std::string>& rendered, const Json& entry,
                       const std::string& expected_output) {
  if (entry.contains("error")) {
    const std::string error = entry["error"].get<std::string>();
    ASSERT_FALSE(rendered.ok()) << "jinja2 raised " << entry["error_type"].get<std::string>()
                                << ": " << error << "\nbut the render gave:\n"
                                << rendered.value();
    EXPECT_EQ(rendered.status().code(), StatusCode::kInvalidArgument);
    if (entry["raised_by_template"].get<bool>()) {
      EXPECT_EQ(rendered.status().message(), error);
    } else {
      EXPECT_NE(rendered.status().message().find(error), std::string::npos)
          << "jinja2: " << error << "\nhere:   " << rendered.status().message();
      EXPECT_EQ(rendered.status().message().rfind("chat template line ", 0), 0u)
          << rendered.status().message();
    }
    return;
  }
  ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
  EXPECT_EQ(rendered.value(), expected_output);
}

class RealTemplates : public ::testing::TestWithParam<JinjaCase> {};

TEST_P(RealTemplates, RenderAsJinja2) {
  const Json& entry = GetParam().entry;
  const std::string source = ReadFile(kDir + "/" + entry["template"].get<std::string>());
  ASSERT_FALSE(source.empty());
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(source);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  const std::string expected =
      entry.contains("expected") ? ReadFile(kDir + "/" + entry["expected"].get<std::string>()) : "";
  ExpectSameAsJinja(tmpl->Render(entry["context"], FixedClock()), entry, expected);
}

INSTANTIATE_TEST_SUITE_P(Jinja2, RealTemplates, ::testing::ValuesIn(LoadCases("cases.json")),
                         [](const auto& test_info) { return test_info.param.name; });

class LanguagePieces : public ::testing::TestWithParam<JinjaCase> {};

TEST_P(LanguagePieces, RenderAsJinja2) {
  const Json& entry = GetParam().entry;
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(entry["template"].get<std::string>());
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  const std::string expected = entry.contains("output") ? entry["output"].get<std::string>() : "";
  ExpectSameAsJinja(tmpl->Render(entry["context"], FixedClock()), entry, expected);
}

INSTANTIATE_TEST_SUITE_P(Jinja2, LanguagePieces,
                         ::testing::ValuesIn(LoadCases("language_cases.json")),
                         [](const auto& test_info) { return test_info.param.name; });

TEST(ChatTemplateFixtures, EveryTemplateHasCases) {
  const std::vector<JinjaCase> cases = LoadCases("cases.json");
  ASSERT_GE(cases.size(), 100u) << "cases.json missing or short: run make_expected.py";
  for (const char* name : {"chatml", "qwen2", "qwen2.5", "llama2-chat", "llama3", "llama3.1",
                           "llama3.2", "mistral-v0.1", "mistral-v0.2", "mistral-nemo"}) {
    int n = 0;
    for (const JinjaCase& c : cases) n += c.entry["template"] == std::string(name) + ".jinja";
    EXPECT_GE(n, 8) << name;
  }
  EXPECT_GE(LoadCases("language_cases.json").size(), 80u);
}

void ExpectOutput(const Result<std::string>& r, std::string_view expected) {
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r.value(), expected);
}

// ---- parsing

Status ParseError(std::string_view source) {
  Result<ChatTemplate> t = ChatTemplate::Parse(source);
  EXPECT_FALSE(t.ok()) << source;
  return t.ok() ? Status::Ok() : t.status();
}

TEST(ChatTemplateParse, ErrorsNameLineAndColumn) {
  Status s = ParseError("line one\n{% if x %}\n  {{ a | nosuchfilter }}\n{% endif %}");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "line 3, column 10: no filter named 'nosuchfilter' (not in this renderer's subset)");

  s = ParseError("{{ x is nosuchtest }}");
  EXPECT_EQ(s.message(),
            "line 1, column 9: no test named 'nosuchtest' (not in this renderer's subset)");

  s = ParseError("{% if x %}never closed");
  EXPECT_EQ(s.message(),
            "line 1, column 23: unexpected end of template: expected 'elif' or 'else' or 'endif'");

  s = ParseError("{{ 'é' + }}");
  EXPECT_EQ(s.message(), "line 1, column 10: unexpected 'end of print statement'");

  s = ParseError("a\n{{ x ) }}");
  EXPECT_EQ(s.message(), "line 2, column 6: unexpected ')'");

  s = ParseError("{{ [1, 2) }}");
  EXPECT_EQ(s.message(), "line 1, column 9: unexpected ')', expected ']'");

  s = ParseError("{{ x $ y }}");
  EXPECT_EQ(s.message(), "line 1, column 6: unexpected char '$'");

  s = ParseError("{% frobnicate %}");
  EXPECT_EQ(s.message(), "line 1, column 4: Encountered unknown tag 'frobnicate'.");

  s = ParseError("{% include 'other.jinja' %}");
  EXPECT_EQ(s.message(), "line 1, column 4: the 'include' tag is not supported by this renderer");

  s = ParseError("{# never closed");
  EXPECT_EQ(s.message(), "line 1, column 1: Missing end of comment tag");

  s = ParseError("{{ 'unterminated }}");
  EXPECT_NE(s.message().find("unexpected char"), std::string::npos) << s.message();

  s = ParseError("{{ x");
  EXPECT_EQ(s.message(), "line 1, column 1: unexpected end of template, expected '}}'");

  s = ParseError("{% break %}");
  EXPECT_EQ(s.message(), "line 1, column 4: 'break' outside of a loop");

  s = ParseError("{% for x in y recursive %}{% endfor %}");
  EXPECT_NE(s.message().find("recursive loops are not supported"), std::string::npos);

  s = ParseError("{{ 99999999999999999999 }}");
  EXPECT_NE(s.message().find("integer literal too large"), std::string::npos);

  s = ParseError("{% set 1 = 2 %}");
  EXPECT_NE(s.message().find("can't assign"), std::string::npos);

  s = ParseError("{{ 'a' \\N{DASH} }}");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);

  s = ParseError("{{ 'x' }}\n\xff");
  EXPECT_EQ(s.message(), "line 2: the template is not valid UTF-8");
}

TEST(ChatTemplateParse, NestingIsBoundedNotAStackOverflow) {
  std::string deep(5000, '(');
  deep = "{{ " + deep + "1" + std::string(5000, ')') + " }}";
  Status s = ParseError(deep);
  EXPECT_NE(s.message().find("nesting deeper than"), std::string::npos) << s.message();

  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if true %}";
  s = ParseError(blocks);
  EXPECT_NE(s.message().find("nesting deeper than"), std::string::npos) << s.message();

  // What real templates nest is far below the bound.
  std::string shallow = "{{ " + std::string(20, '(') + "1" + std::string(20, ')') + " }}";
  EXPECT_TRUE(ChatTemplate::Parse(shallow).ok());
}

TEST(ChatTemplateParse, SourceSizeIsBounded) {
  std::string huge(ChatTemplate::kMaxSourceBytes + 1, 'a');
  Status s = ParseError(huge);
  EXPECT_NE(s.message().find("larger than"), std::string::npos);
}

TEST(ChatTemplateParse, CopiesShareTheProgram) {
  Result<ChatTemplate> t = ChatTemplate::Parse("{{ x }}!");
  ASSERT_TRUE(t.ok());
  const ChatTemplate copy = *t;
  EXPECT_EQ(copy.source(), "{{ x }}!");
  ExpectOutput(copy.Render(Json{{"x", 1}}), "1!");
}

// ---- rendering

Result<std::string> Render(std::string_view source, const Json& context,
                           const ChatTemplateOptions& options = {}) {
  Result<ChatTemplate> t = ChatTemplate::Parse(source);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return t.status();
  return t->Render(context, options);
}

TEST(ChatTemplateRender, RaiseExceptionMessageIsKeptAsIs) {
  Result<std::string> r = Render(
      "{% for m in messages %}{% if m.role == 'system' %}"
      "{{ raise_exception('System role not supported: ' ~ m.content) }}{% endif %}{% endfor %}",
      Json{{"messages", Json::array({{{"role", "system"}, {"content", "x"}}})}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "System role not supported: x");
}

TEST(ChatTemplateRender, RuntimeErrorsNameTheLine) {
  Result<std::string> r = Render("a\n\n{% if true %}\n{{ messages[0].content + 1 }}\n{% endif %}",
                                 Json{{"messages", Json::array({{{"content", "x"}}})}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "chat template line 4: can only concatenate str (not \"int\") to str");
}

TEST(ChatTemplateRender, ContextMustBeAnObjectOfValidUtf8) {
  Result<std::string> r = Render("{{ x }}", Json::array({1}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);

  r = Render("{{ x }}", Json{{"x", std::string("a\xc3")}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not valid UTF-8"), std::string::npos);
}

TEST(ChatTemplateRender, ObjectsKeepTheirOrderInTojson) {
  Json tool = Json::object();
  tool["zeta"] = 1;
  tool["alpha"] = Json::array({true, nullptr, 2.5});
  ExpectOutput(Render("{{ t|tojson }}", Json{{"t", tool}}),
               "{\"zeta\": 1, \"alpha\": [true, null, 2.5]}");
}

TEST(ChatTemplateRender, LargeUnsignedIntegersBecomeFloats) {
  ExpectOutput(Render("{{ n }}", Json{{"n", 18446744073709551615ull}}), "1.8446744073709552e+19");
}

TEST(ChatTemplateRender, IntegerOverflowIsAnError) {
  Result<std::string> r = Render("{{ 9223372036854775807 + 1 }}", Json::object());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("integer overflow"), std::string::npos);
  r = Render("{{ 2 ** 64 }}", Json::object());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("integer overflow"), std::string::npos);
}

TEST(ChatTemplateRender, StrftimeNowReadsTheInjectedClock) {
  ExpectOutput(Render("{{ strftime_now('%d %b %Y') }}", Json::object(), FixedClock()),
               "09 Mar 2025");
  // Unset: the current local time.
  Result<std::string> now = Render("{{ strftime_now('%Y') }}", Json::object());
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->size(), 4u);
}

TEST(ChatTemplateRender, ConcurrentRendersOfOneTemplate) {
  Result<ChatTemplate> t = ChatTemplate::Parse(ReadFile(kDir + "/llama3.1.jinja"));
  ASSERT_TRUE(t.ok());
  const Json context = {{"messages", Json::array({{{"role", "user"}, {"content", "hi"}}})},
                        {"add_generation_prompt", true},
                        {"bos_token", "<|begin_of_text|>"}};
  const Result<std::string> first = t->Render(context);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const std::string expected = first.value();
  std::vector<std::thread> threads;
  std::vector<std::string> outputs(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k) {
        const Result<std::string> r = t->Render(context);
        outputs[i] = r.ok() ? r.value() : r.status().ToString();
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (const std::string& out : outputs) EXPECT_EQ(out, expected);
}

// ---- limits: each reachable from a request's messages

ChatTemplateOptions Limits(size_t bytes, int64_t iterations, int depth) {
  ChatTemplateOptions options;
  options.limits.max_output_bytes = bytes;
  options.limits.max_loop_iterations = iterations;
  options.limits.max_depth = depth;
  return options;
}

void ExpectLimit(const Result<std::string>& r, std::string_view limit) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  EXPECT_NE(r.status().message().find(limit), std::string::npos) << r.status().message();
}

TEST(ChatTemplateLimits, OutputBytes) {
  const Json context = {{"messages", Json::array({{{"content", std::string(600, 'x')}},
                                                  {{"content", std::string(600, 'y')}}})}};
  const char* source = "{% for m in messages %}{{ m.content }}{% endfor %}";
  EXPECT_TRUE(Render(source, context, Limits(1200, 100, 64)).ok());
  ExpectLimit(Render(source, context, Limits(1199, 100, 64)), "max_output_bytes (1199)");
}

TEST(ChatTemplateLimits, StringsBuiltInsideTheTemplate) {
  // Doubling a string through a namespace would need 2^40 bytes.
  ExpectLimit(Render("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                     "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
                     Json::object(), Limits(1 << 20, 1000, 64)),
              "max_output_bytes");
  ExpectLimit(Render("{{ ('x' * 100000000)|length }}", Json::object(), Limits(1 << 20, 1000, 64)),
              "max_output_bytes");
  ExpectLimit(
      Render("{% set x = 'ab' * 1000 %}{{ x|tojson }}", Json::object(), Limits(1500, 1000, 64)),
      "max_output_bytes");
  ExpectLimit(Render("{{ ['ab'] * 1000 }}", Json::object(), Limits(1500, 1000000, 64)),
              "max_output_bytes");
}

TEST(ChatTemplateLimits, LoopIterations) {
  const char* nested =
      "{% for a in range(1000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}done";
  ExpectLimit(Render(nested, Json::object(), Limits(1 << 20, 100000, 64)),
              "max_loop_iterations (100000)");
  // range(1000) builds 1000 items 1001 times, and the loops run 1001000 times.
  ExpectOutput(Render(nested, Json::object(), Limits(1 << 20, 2002000, 64)), "done");
  ExpectLimit(Render(nested, Json::object(), Limits(1 << 20, 2001999, 64)), "max_loop_iterations");
  // Lists grown by repetition count their items.
  ExpectLimit(Render("{{ ([0] * 100000000)|length }}", Json::object(), Limits(1 << 20, 1000, 64)),
              "max_loop_iterations");
  // Filters over a request's messages count their items.
  Json many = Json::array();
  for (int i = 0; i < 200; ++i) many.push_back({{"role", "user"}});
  ExpectLimit(
      Render(
          "{% for m in messages %}{{ messages|selectattr('role', 'equalto', 'user')|list|length }}"
          "{% endfor %}",
          Json{{"messages", many}}, Limits(1 << 20, 10000, 64)),
      "max_loop_iterations");
}

TEST(ChatTemplateLimits, RecursionDepth) {
  ExpectLimit(Render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", Json::object(),
                     Limits(1 << 20, 1000000, 256)),
              "max_depth (256)");
  ExpectLimit(
      Render("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(100) }}",
             Json::object(), Limits(1 << 20, 1000000, 64)),
      "max_depth (64)");
  EXPECT_TRUE(
      Render("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(10) }}",
             Json::object(), Limits(1 << 20, 1000000, 256))
          .ok());
}

TEST(ChatTemplateLimits, ContextNesting) {
  Json deep = "leaf";
  for (int i = 0; i < 100; ++i) deep = Json::array({deep});
  ExpectLimit(Render("{{ x|length }}", Json{{"x", deep}}, Limits(1 << 20, 1000, 64)),
              "the context nests deeper than max_depth (64)");
  EXPECT_TRUE(Render("{{ x|length }}", Json{{"x", deep}}, Limits(1 << 20, 1000, 256)).ok());
}

TEST(ChatTemplateLimits, DeepValuesPrintWithinTheDepth) {
  // tojson and repr of deep lists recurse; both are bounded.
  ExpectLimit(Render("{% set ns = namespace(v=[]) %}{% for i in range(300) %}"
                     "{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v|tojson }}",
                     Json::object(), Limits(1 << 20, 100000, 100)),
              "max_depth (100)");
  ExpectLimit(Render("{% set ns = namespace(v=[]) %}{% for i in range(300) %}"
                     "{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v }}",
                     Json::object(), Limits(1 << 20, 100000, 100)),
              "max_depth (100)");
}

// ---- tokenizer_config.json

class TokenizerConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/chat_template_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    for (const char* name : {"tokenizer_config.json", "chat_template.jinja"}) {
      std::remove((dir_ + "/" + name).c_str());
    }
    rmdir(dir_.c_str());
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(TokenizerConfigFiles, StringTemplateAndTokens) {
  Json config = {{"add_bos_token", true},
                 {"add_eos_token", false},
                 {"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}, {"lstrip", false}}},
                 {"eos_token", "</s>"},
                 {"unk_token", nullptr},
                 {"chat_template", ReadFile(kDir + "/mistral-v0.1.jinja")}};
  Result<ChatTemplateConfig> c = ReadTokenizerConfig(Write("tokenizer_config.json", config.dump()));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->bos_token, "<s>");
  EXPECT_EQ(c->eos_token, "</s>");
  EXPECT_FALSE(c->unk_token.has_value());
  EXPECT_EQ(c->add_bos_token, true);
  EXPECT_EQ(c->add_eos_token, false);
  EXPECT_EQ(c->template_file, "tokenizer_config.json");
  ASSERT_TRUE(c->chat_template.has_value());
  EXPECT_TRUE(c->named_templates.empty());
  EXPECT_EQ(c->SpecialTokens().dump(), R"({"bos_token":"<s>","eos_token":"</s>"})");

  Json context = c->SpecialTokens();
  context["messages"] = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  ExpectOutput(c->Select(false)->Render(context), "<s>[INST] Hi [/INST]");
}

TEST_F(TokenizerConfigFiles, NamedTemplates) {
  Json config = {
      {"chat_template", Json::array({{{"name", "default"}, {"template", "D{{ x }}"}},
                                     {{"name", "tool_use"}, {"template", "T{{ x }}"}}})}};
  Result<ChatTemplateConfig> c = ReadTokenizerConfig(Write("tokenizer_config.json", config.dump()));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->named_templates.size(), 2u);
  ExpectOutput(c->Select(false)->Render(Json{{"x", 1}}), "D1");
  ExpectOutput(c->Select(true)->Render(Json{{"x", 1}}), "T1");
  EXPECT_FALSE(c->add_bos_token.has_value());
}

TEST_F(TokenizerConfigFiles, TemplateParseErrorNamesTheFileAndPosition) {
  Json config = {
      {"chat_template", "{% for m in messages %}\n{{ m.content | bogus }}\n{% endfor %}"}};
  const std::string path = Write("tokenizer_config.json", config.dump());
  Result<ChatTemplateConfig> c = ReadTokenizerConfig(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            path +
                ": chat_template: line 2, column 16: no filter named 'bogus' (not in this "
                "renderer's subset)");

  config = {{"chat_template", Json::array({{{"name", "rag"}, {"template", "{% if %}"}}})}};
  c = ReadTokenizerConfig(Write("tokenizer_config.json", config.dump()));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("tokenizer_config.json: chat_template \"rag\": line 1"),
            std::string::npos)
      << c.status().message();
}

TEST_F(TokenizerConfigFiles, ChatTemplateJinjaBeside) {
  Write("chat_template.jinja", "J{{ messages|length }}\n");
  Result<ChatTemplateConfig> c =
      ReadTokenizerConfig(Write("tokenizer_config.json", R"({"eos_token": "</s>"})"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->template_file, "chat_template.jinja");
  ASSERT_TRUE(c->chat_template.has_value());
  ExpectOutput(c->chat_template->Render(Json{{"messages", Json::array({1, 2})}}), "J2");

  // The file replaces the config's templates.
  Json config = {{"chat_template", Json::array({{{"name", "default"}, {"template", "D"}},
                                                {{"name", "tool_use"}, {"template", "T"}}})}};
  c = ReadTokenizerConfig(Write("tokenizer_config.json", config.dump()));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->template_file, "chat_template.jinja");
  EXPECT_TRUE(c->named_templates.empty());
  ExpectOutput(c->Select(true)->Render(Json{{"messages", Json::array()}}), "J0");

  Write("chat_template.jinja", "{{ unclosed");
  c = ReadTokenizerConfig(dir_ + "/tokenizer_config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("chat_template.jinja: template: line 1"), std::string::npos)
      << c.status().message();
}

TEST_F(TokenizerConfigFiles, NoTemplate) {
  Result<ChatTemplateConfig> c =
      ReadTokenizerConfig(Write("tokenizer_config.json", R"({"chat_template": null})"));
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->chat_template.has_value());
  EXPECT_EQ(c->Select(true), nullptr);
}

TEST_F(TokenizerConfigFiles, MalformedFiles) {
  EXPECT_EQ(ReadTokenizerConfig(dir_ + "/missing.json").status().code(), StatusCode::kNotFound);

  const struct {
    const char* json;
    const char* error;
  } cases[] = {
      {"{not json", "malformed JSON"},
      {"[1]", "expected a JSON object"},
      {R"({"chat_template": 5})", "\"chat_template\" must be a string or a list"},
      {R"({"chat_template": [{"name": "default"}]})", "chat_template[0] must be an object"},
      {R"({"chat_template": [{"name": "a", "template": "x"}, {"name": "a", "template": "y"}]})",
       "a second template named \"a\""},
      {R"({"bos_token": 7})", "\"bos_token\" must be a string"},
      {R"({"eos_token": {"content": 1}})", "\"eos_token\" must be a string"},
      {R"({"add_bos_token": "yes"})", "\"add_bos_token\" must be true or false, got \"yes\""},
  };
  for (const auto& c : cases) {
    Result<ChatTemplateConfig> r = ParseTokenizerConfig(c.json, "tokenizer_config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message().rfind("tokenizer_config.json: ", 0), 0u) << r.status().message();
    EXPECT_NE(r.status().message().find(c.error), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace hearth::llm
