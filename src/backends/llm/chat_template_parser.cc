// The parser of chat templates: jinja2 3.1's parser.py for the subset
// chat_template.h lists, with the same operator precedence (filters bind
// tighter than arithmetic, `~` tighter than `+`) and the same errors.
#include <algorithm>
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {
namespace {

const char* const kFilters[] = {
    "abs",     "capitalize", "count",  "d",      "default",    "dictsort",  "e",          "escape",
    "first",   "float",      "indent", "int",    "items",      "join",      "last",       "length",
    "list",    "lower",      "map",    "max",    "min",        "reject",    "rejectattr", "replace",
    "reverse", "round",      "safe",   "select", "selectattr", "sort",      "string",     "sum",
    "title",   "tojson",     "trim",   "unique", "upper",      "wordcount",
};

const char* const kTests[] = {
    "boolean", "callable", "defined",  "divisibleby", "eq",       "equalto", "escaped",
    "even",    "false",    "filter",   "float",       "ge",       "gt",      "greaterthan",
    "in",      "integer",  "iterable", "le",          "lessthan", "lower",   "lt",
    "mapping", "ne",       "none",     "number",      "odd",      "sameas",  "sequence",
    "string",  "test",     "true",     "undefined",   "upper",    "==",      "!=",
    "<",       "<=",       ">",        ">=",
};

class Parser {
 public:
  Parser(std::vector<Token> tokens, const Positions& positions)
      : tokens_(std::move(tokens)), positions_(positions) {}

  std::unique_ptr<Program> Run() {
    auto program = std::make_unique<Program>();
    program->body = Subparse({});
    if (Cur().type != Tok::kEof) FailHere("unexpected '" + Describe(Cur()) + "'");
    return program;
  }

 private:
  // ---- token stream

  const Token& Cur() const { return tokens_[pos_]; }
  const Token& Look(size_t ahead = 1) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool IsOp(const Token& t, std::string_view op) const {
    return t.type == Tok::kOp && t.value == op;
  }
  bool IsName(const Token& t, std::string_view name) const {
    return t.type == Tok::kName && t.value == name;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(Cur(), op)) return false;
    Next();
    return true;
  }
  bool SkipName(std::string_view name) {
    if (!IsName(Cur(), name)) return false;
    Next();
    return true;
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kData:
        return "template data";
      case Tok::kVarBegin:
        return "begin of print statement";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kBlockBegin:
        return "begin of statement block";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kString:
        return "string";
      case Tok::kInt:
        return "integer";
      case Tok::kFloat:
        return "float";
      case Tok::kEof:
        return "end of template";
      default:
        return t.value;
    }
  }

  [[noreturn]] void FailHere(const std::string& message) const {
    positions_.FailAt(Cur().offset, message);
  }
  [[noreturn]] void FailAt(const Token& t, const std::string& message) const {
    positions_.FailAt(t.offset, message);
  }

  void ExpectOp(std::string_view op) {
    if (!SkipOp(op)) {
      FailHere("expected '" + std::string(op) + "', got '" + Describe(Cur()) + "'");
    }
  }
  const Token& ExpectName() {
    if (Cur().type != Tok::kName) FailHere("expected a name, got '" + Describe(Cur()) + "'");
    return Next();
  }
  void Expect(Tok type, const char* what) {
    if (Cur().type != type)
      FailHere(std::string("expected '") + what + "', got '" + Describe(Cur()) + "'");
    Next();
  }

  class Deeper {
   public:
    explicit Deeper(Parser& p) : p_(p) {
      if (++p_.depth_ > ChatTemplate::kMaxParseDepth) {
        p_.FailHere("nesting deeper than " + std::to_string(ChatTemplate::kMaxParseDepth) +
                    " levels");
      }
    }
    ~Deeper() { --p_.depth_; }

   private:
    Parser& p_;
  };

  ExprPtr Make(Expr::Type type, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = positions_.Line(at.offset);
    e->column = positions_.Column(at.offset);
    return e;
  }

  // ---- statements

  // Statements up to a block tag named in `end_tags`, left as the current
  // token (past its `{%`); or to the end of the template.
  Body Subparse(const std::vector<std::string_view>& end_tags) {
    Deeper deeper(*this);
    Body body;
    while (Cur().type != Tok::kEof) {
      const Token& t = Cur();
      if (t.type == Tok::kData) {
        auto s = std::make_unique<Stmt>();
        s->type = Stmt::Type::kText;
        s->line = positions_.Line(t.offset);
        s->text = t.value;
        body.push_back(std::move(s));
        Next();
      } else if (t.type == Tok::kVarBegin) {
        Next();
        auto s = std::make_unique<Stmt>();
        s->type = Stmt::Type::kOutput;
        s->line = positions_.Line(Cur().offset);
        s->expr = ParseTuple(false, true, {}, false);
        Expect(Tok::kVarEnd, "}}");
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        Next();
        if (Cur().type == Tok::kName &&
            std::find(end_tags.begin(), end_tags.end(), Cur().value) != end_tags.end()) {
          return body;
        }
        body.push_back(ParseStatement());
        Expect(Tok::kBlockEnd, "%}");
      } else {
        FailHere("unexpected '" + Describe(t) + "'");
      }
    }
    if (!end_tags.empty()) {
      std::string expected;
      for (std::string_view tag : end_tags) {
        expected += (expected.empty() ? "'" : " or '") + std::string(tag) + "'";
      }
      FailHere("unexpected end of template: expected " + expected);
    }
    return body;
  }

  // The body after a tag: its `%}`, then statements up to one of `end_tags`.
  Body ParseStatements(const std::vector<std::string_view>& end_tags, bool drop_needle) {
    SkipOp(":");
    Expect(Tok::kBlockEnd, "%}");
    Body body = Subparse(end_tags);
    if (drop_needle) Next();
    return body;
  }

  StmtPtr NewStmt(Stmt::Type type, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->type = type;
    s->line = positions_.Line(at.offset);
    return s;
  }

  StmtPtr ParseStatement() {
    const Token& t = Cur();
    if (t.type != Tok::kName) FailHere("tag name expected");
    const std::string tag = t.value;
    if (tag == "for") return ParseFor();
    if (tag == "if") return ParseIf();
    if (tag == "set") return ParseSet();
    if (tag == "macro") return ParseMacro();
    if (tag == "with") return ParseWith();
    if (tag == "filter") return ParseFilterBlock();
    if (tag == "generation") {
      auto s = NewStmt(Stmt::Type::kScope, Next());
      s->body = ParseStatements({"endgeneration"}, true);
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) FailHere("'" + tag + "' outside of a loop");
      return NewStmt(tag == "break" ? Stmt::Type::kBreak : Stmt::Type::kContinue, Next());
    }
    static const char* const kUnsupported[] = {"block", "extends",    "include", "import", "from",
                                               "call",  "autoescape", "do",      "trans"};
    for (const char* name : kUnsupported) {
      if (tag == name) FailHere("the '" + tag + "' tag is not supported by this renderer");
    }
    FailHere("Encountered unknown tag '" + tag + "'.");
  }

  StmtPtr ParseFor() {
    auto s = NewStmt(Stmt::Type::kFor, Next());
    s->target = ParseAssignTarget(false, {"in"});
    if (!SkipName("in")) FailHere("expected 'in', got '" + Describe(Cur()) + "'");
    s->expr = ParseTuple(false, false, {"recursive"}, false);
    if (SkipName("if")) s->cond = ParseExpression(true);
    if (IsName(Cur(), "recursive")) FailHere("recursive loops are not supported by this renderer");
    ++loop_depth_;
    s->body = ParseStatements({"endfor", "else"}, false);
    --loop_depth_;
    if (Next().value == "else") s->else_body = ParseStatements({"endfor"}, true);
    return s;
  }

  StmtPtr ParseIf() {
    auto s = NewStmt(Stmt::Type::kIf, Next());
    while (true) {
      ExprPtr cond = ParseTuple(false, false, {}, false);
      Body body = ParseStatements({"elif", "else", "endif"}, false);
      s->branches.emplace_back(std::move(cond), std::move(body));
      const Token& end = Next();
      if (end.value == "elif") continue;
      if (end.value == "else") s->else_body = ParseStatements({"endif"}, true);
      break;
    }
    return s;
  }

  StmtPtr ParseSet() {
    auto s = NewStmt(Stmt::Type::kSet, Next());
    s->target = ParseAssignTarget(true, {});
    if (SkipOp("=")) {
      s->expr = ParseTuple(false, true, {}, false);
      return s;
    }
    s->type = Stmt::Type::kSetBlock;
    if (IsOp(Cur(), "|")) s->expr = ParseFilter(nullptr, false);
    s->body = ParseStatements({"endset"}, true);
    return s;
  }

  StmtPtr ParseMacro() {
    auto s = NewStmt(Stmt::Type::kMacro, Next());
    s->name = ExpectName().value;
    ExpectOp("(");
    while (!IsOp(Cur(), ")")) {
      if (!s->params.empty()) ExpectOp(",");
      s->params.push_back(ExpectName().value);
      if (SkipOp("=")) {
        s->defaults.push_back(ParseExpression(true));
      } else if (!s->defaults.empty()) {
        FailHere("non-default argument follows default argument");
      }
    }
    ExpectOp(")");
    const int saved_loops = loop_depth_;
    loop_depth_ = 0;
    s->body = ParseStatements({"endmacro"}, true);
    loop_depth_ = saved_loops;
    return s;
  }

  StmtPtr ParseWith() {
    auto s = NewStmt(Stmt::Type::kWith, Next());
    while (Cur().type != Tok::kBlockEnd) {
      if (!s->params.empty()) ExpectOp(",");
      s->params.push_back(ExpectName().value);
      ExpectOp("=");
      s->defaults.push_back(ParseExpression(true));
    }
    s->body = ParseStatements({"endwith"}, true);
    return s;
  }

  StmtPtr ParseFilterBlock() {
    auto s = NewStmt(Stmt::Type::kFilterBlock, Next());
    s->expr = ParseFilter(nullptr, true);
    s->body = ParseStatements({"endfilter"}, true);
    return s;
  }

  // A name, a tuple of names (for a, b in ...), or ns.attr (set only).
  Target ParseAssignTarget(bool with_namespace, const std::vector<std::string_view>& end_rules) {
    Target target;
    if (with_namespace && Cur().type == Tok::kName && IsOp(Look(), ".")) {
      target.names.push_back(Next().value);
      Next();
      target.attr = ExpectName().value;
      return target;
    }
    const Token& start = Cur();
    ExprPtr e = ParseTuple(true, true, end_rules, false);
    auto add_name = [&](const Expr& n) {
      if (n.type != Expr::Type::kName) {
        FailAt(start, "can't assign to this expression (names, tuples of names and ns.attr only)");
      }
      target.names.push_back(n.name);
    };
    if (e->type == Expr::Type::kTuple) {
      target.tuple = true;
      for (const ExprPtr& item : e->children) add_name(*item);
    } else {
      add_name(*e);
    }
    return target;
  }

  // ---- expressions

  bool IsTupleEnd(const std::vector<std::string_view>& extra_end_rules) const {
    const Token& t = Cur();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || IsOp(t, ")")) return true;
    if (t.type == Tok::kName) {
      for (std::string_view rule : extra_end_rules) {
        if (t.value == rule) return true;
      }
    }
    return false;
  }

  ExprPtr ParseTuple(bool simplified, bool with_condexpr,
                     const std::vector<std::string_view>& extra_end_rules, bool explicit_parens) {
    const Token& start = Cur();
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) ExpectOp(",");
      if (IsTupleEnd(extra_end_rules)) break;
      args.push_back(simplified ? ParsePrimary() : ParseExpression(with_condexpr));
      if (IsOp(Cur(), ",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parens) FailHere("Expected an expression, got '" + Describe(Cur()) + "'");
    }
    ExprPtr e = Make(Expr::Type::kTuple, start);
    e->children = std::move(args);
    return e;
  }

  ExprPtr ParseExpression(bool with_condexpr) {
    Deeper deeper(*this);
    return with_condexpr ? ParseCondExpr() : ParseOr();
  }

  ExprPtr ParseCondExpr() {
    ExprPtr expr1 = ParseOr();
    while (IsName(Cur(), "if")) {
      const Token& at = Next();
      ExprPtr cond = ParseOr();
      ExprPtr expr3;
      if (SkipName("else")) expr3 = ParseCondExpr();
      ExprPtr e = Make(Expr::Type::kCond, at);
      e->children.push_back(std::move(cond));
      e->children.push_back(std::move(expr1));
      e->children.push_back(std::move(expr3));
      expr1 = std::move(e);
    }
    return expr1;
  }

  ExprPtr Binary(Expr::Type type, const Token& at, ExprPtr left, ExprPtr right) {
    ExprPtr e = Make(type, at);
    e->children.push_back(std::move(left));
    e->children.push_back(std::move(right));
    return e;
  }

  ExprPtr ParseOr() {
    ExprPtr left = ParseAnd();
    while (IsName(Cur(), "or")) {
      const Token& at = Next();
      left = Binary(Expr::Type::kOr, at, std::move(left), ParseAnd());
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (IsName(Cur(), "and")) {
      const Token& at = Next();
      left = Binary(Expr::Type::kAnd, at, std::move(left), ParseNot());
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName(Cur(), "not")) {
      Deeper deeper(*this);
      const Token& at = Next();
      ExprPtr e = Make(Expr::Type::kNot, at);
      e->children.push_back(ParseNot());
      return e;
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    const Token& start = Cur();
    ExprPtr expr = ParseMath1();
    ExprPtr cmp;
    while (true) {
      CompareOp op;
      const Token& t = Cur();
      if (IsOp(t, "==")) {
        op = CompareOp::kEq;
      } else if (IsOp(t, "!=")) {
        op = CompareOp::kNe;
      } else if (IsOp(t, "<")) {
        op = CompareOp::kLt;
      } else if (IsOp(t, "<=")) {
        op = CompareOp::kLe;
      } else if (IsOp(t, ">")) {
        op = CompareOp::kGt;
      } else if (IsOp(t, ">=")) {
        op = CompareOp::kGe;
      } else if (IsName(t, "in")) {
        op = CompareOp::kIn;
      } else if (IsName(t, "not") && IsName(Look(), "in")) {
        op = CompareOp::kNotIn;
        Next();
      } else {
        break;
      }
      Next();
      if (!cmp) {
        cmp = Make(Expr::Type::kCompare, start);
        cmp->children.push_back(std::move(expr));
      }
      cmp->ops.push_back(op);
      cmp->children.push_back(ParseMath1());
    }
    return cmp ? std::move(cmp) : std::move(expr);
  }

  ExprPtr Arith(BinaryOp op, const Token& at, ExprPtr left, ExprPtr right) {
    ExprPtr e = Binary(Expr::Type::kBinary, at, std::move(left), std::move(right));
    e->op = op;
    return e;
  }

  ExprPtr ParseMath1() {
    ExprPtr left = ParseConcat();
    while (IsOp(Cur(), "+") || IsOp(Cur(), "-")) {
      const Token& at = Next();
      left = Arith(at.value == "+" ? BinaryOp::kAdd : BinaryOp::kSub, at, std::move(left),
                   ParseConcat());
    }
    return left;
  }

  ExprPtr ParseConcat() {
    const Token& start = Cur();
    ExprPtr first = ParseMath2();
    if (!IsOp(Cur(), "~")) return first;
    ExprPtr e = Make(Expr::Type::kConcat, start);
    e->children.push_back(std::move(first));
    while (SkipOp("~")) e->children.push_back(ParseMath2());
    return e;
  }

  ExprPtr ParseMath2() {
    ExprPtr left = ParsePow();
    while (true) {
      BinaryOp op;
      if (IsOp(Cur(), "*")) {
        op = BinaryOp::kMul;
      } else if (IsOp(Cur(), "/")) {
        op = BinaryOp::kDiv;
      } else if (IsOp(Cur(), "//")) {
        op = BinaryOp::kFloorDiv;
      } else if (IsOp(Cur(), "%")) {
        op = BinaryOp::kMod;
      } else {
        break;
      }
      const Token& at = Next();
      left = Arith(op, at, std::move(left), ParsePow());
    }
    return left;
  }

  ExprPtr ParsePow() {
    ExprPtr left = ParseUnary(true);
    while (IsOp(Cur(), "**")) {
      const Token& at = Next();
      left = Arith(BinaryOp::kPow, at, std::move(left), ParseUnary(true));
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    Deeper deeper(*this);
    ExprPtr node;
    if (IsOp(Cur(), "-") || IsOp(Cur(), "+")) {
      const Token& at = Next();
      node = Make(Expr::Type::kNeg, at);
      node->name = at.value;
      node->children.push_back(ParseUnary(false));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary() {
    Deeper deeper(*this);
    const Token& t = Cur();
    ExprPtr node;
    switch (t.type) {
      case Tok::kName:
        node = Make(Expr::Type::kLiteral, t);
        if (t.value == "true" || t.value == "True") {
          node->literal = Value::Bool(true);
        } else if (t.value == "false" || t.value == "False") {
          node->literal = Value::Bool(false);
        } else if (t.value == "none" || t.value == "None") {
          node->literal = Value::None();
        } else {
          node->type = Expr::Type::kName;
          node->name = t.value;
        }
        Next();
        return node;
      case Tok::kString: {
        node = Make(Expr::Type::kLiteral, t);
        std::string s;
        while (Cur().type == Tok::kString) s += Next().value;
        node->literal = Value::String(std::move(s));
        return node;
      }
      case Tok::kInt:
        node = Make(Expr::Type::kLiteral, t);
        node->literal = Value::Int(t.int_value);
        Next();
        return node;
      case Tok::kFloat:
        node = Make(Expr::Type::kLiteral, t);
        node->literal = Value::Float(t.float_value);
        Next();
        return node;
      default:
        break;
    }
    if (IsOp(t, "(")) {
      Next();
      node = ParseTuple(false, true, {}, true);
      ExpectOp(")");
      return node;
    }
    if (IsOp(t, "[")) return ParseList();
    if (IsOp(t, "{")) return ParseDict();
    FailHere("unexpected '" + Describe(t) + "'");
  }

  ExprPtr ParseList() {
    ExprPtr e = Make(Expr::Type::kList, Next());
    while (!IsOp(Cur(), "]")) {
      if (!e->children.empty()) ExpectOp(",");
      if (IsOp(Cur(), "]")) break;
      e->children.push_back(ParseExpression(true));
    }
    ExpectOp("]");
    return e;
  }

  ExprPtr ParseDict() {
    ExprPtr e = Make(Expr::Type::kDict, Next());
    while (!IsOp(Cur(), "}")) {
      if (!e->children.empty()) ExpectOp(",");
      if (IsOp(Cur(), "}")) break;
      e->children.push_back(ParseExpression(true));
      ExpectOp(":");
      e->children.push_back(ParseExpression(true));
    }
    ExpectOp("}");
    return e;
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(Cur(), ".") || IsOp(Cur(), "[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp(Cur(), "(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp(Cur(), "|")) {
        node = ParseFilter(std::move(node), false);
      } else if (IsName(Cur(), "is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp(Cur(), "(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr node) {
    Deeper deeper(*this);
    const Token& t = Next();
    if (t.value == ".") {
      const Token& attr = Cur();
      if (attr.type == Tok::kName) {
        ExprPtr e = Make(Expr::Type::kGetAttr, t);
        e->name = attr.value;
        e->children.push_back(std::move(node));
        Next();
        return e;
      }
      if (attr.type != Tok::kInt) FailHere("expected name or number");
      ExprPtr e = Make(Expr::Type::kGetItem, t);
      ExprPtr index = Make(Expr::Type::kLiteral, attr);
      index->literal = Value::Int(attr.int_value);
      Next();
      e->children.push_back(std::move(node));
      e->children.push_back(std::move(index));
      return e;
    }
    // [ ... ]: an index, a slice, or a tuple of them.
    std::vector<ExprPtr> args;
    while (!IsOp(Cur(), "]")) {
      if (!args.empty()) ExpectOp(",");
      args.push_back(ParseSubscribed());
    }
    ExpectOp("]");
    if (args.size() != 1) FailAt(t, "subscripts with several indexes are not supported");
    ExprPtr arg = std::move(args[0]);
    if (arg->type == Expr::Type::kSlice) {
      arg->children[0] = std::move(node);
      return arg;
    }
    ExprPtr e = Make(Expr::Type::kGetItem, t);
    e->children.push_back(std::move(node));
    e->children.push_back(std::move(arg));
    return e;
  }

  // An index, or a slice [start:stop:step] (a kSlice with an empty object
  // slot, filled by the caller).
  ExprPtr ParseSubscribed() {
    const Token& start = Cur();
    std::vector<ExprPtr> parts;
    if (IsOp(Cur(), ":")) {
      Next();
      parts.push_back(nullptr);
    } else {
      ExprPtr node = ParseExpression(true);
      if (!IsOp(Cur(), ":")) return node;
      Next();
      parts.push_back(std::move(node));
    }
    if (IsOp(Cur(), ":")) {
      parts.push_back(nullptr);
    } else if (!IsOp(Cur(), "]") && !IsOp(Cur(), ",")) {
      parts.push_back(ParseExpression(true));
    } else {
      parts.push_back(nullptr);
    }
    if (IsOp(Cur(), ":")) {
      Next();
      if (!IsOp(Cur(), "]") && !IsOp(Cur(), ",")) {
        parts.push_back(ParseExpression(true));
      } else {
        parts.push_back(nullptr);
      }
    } else {
      parts.push_back(nullptr);
    }
    ExprPtr e = Make(Expr::Type::kSlice, start);
    e->children.push_back(nullptr);  // the object
    for (ExprPtr& part : parts) e->children.push_back(std::move(part));
    return e;
  }

  // (args, kw=args) into e->children (after what is already there) and e->kwargs.
  void ParseCallArgs(Expr& e) {
    const Token& open = Cur();
    ExpectOp("(");
    bool require_comma = false;
    while (!IsOp(Cur(), ")")) {
      if (require_comma) {
        ExpectOp(",");
        if (IsOp(Cur(), ")")) break;
      }
      if (IsOp(Cur(), "*") || IsOp(Cur(), "**")) {
        FailHere("*args and **kwargs in calls are not supported by this renderer");
      }
      if (Cur().type == Tok::kName && IsOp(Look(), "=")) {
        std::string key = Next().value;
        Next();
        e.kwargs.emplace_back(std::move(key), ParseExpression(true));
      } else {
        if (!e.kwargs.empty()) FailAt(open, "invalid syntax for function call expression");
        e.children.push_back(ParseExpression(true));
      }
      require_comma = true;
    }
    ExpectOp(")");
  }

  ExprPtr ParseCall(ExprPtr callee) {
    Deeper deeper(*this);
    ExprPtr e = Make(Expr::Type::kCall, Cur());
    e->children.push_back(std::move(callee));
    ParseCallArgs(*e);
    return e;
  }

  // `| name(args)` filters; `start_inline`: the first filter has no `|`
  // ({% filter name %}). A null operand is the block's body.
  ExprPtr ParseFilter(ExprPtr node, bool start_inline) {
    while (IsOp(Cur(), "|") || start_inline) {
      if (!start_inline) Next();
      start_inline = false;
      const Token& name = ExpectName();
      if (IsOp(Cur(), ".")) FailHere("dotted filter names are not supported");
      if (!IsKnownFilter(name.value)) {
        FailAt(name, "no filter named '" + name.value + "' (not in this renderer's subset)");
      }
      ExprPtr e = Make(Expr::Type::kFilter, name);
      e->name = name.value;
      e->children.push_back(std::move(node));
      if (IsOp(Cur(), "(")) ParseCallArgs(*e);
      node = std::move(e);
    }
    return node;
  }

  ExprPtr ParseTest(ExprPtr node) {
    Deeper deeper(*this);
    const Token& is = Next();
    const bool negated = SkipName("not");
    const Token& name = ExpectName();
    if (IsOp(Cur(), ".")) FailHere("dotted test names are not supported");
    if (!IsKnownTest(name.value)) {
      FailAt(name, "no test named '" + name.value + "' (not in this renderer's subset)");
    }
    ExprPtr e = Make(Expr::Type::kTest, is);
    e->name = name.value;
    e->negated = negated;
    e->children.push_back(std::move(node));
    const Token& t = Cur();
    if (IsOp(t, "(")) {
      ParseCallArgs(*e);
    } else if ((t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt ||
                t.type == Tok::kFloat || IsOp(t, "[") || IsOp(t, "{")) &&
               !IsName(t, "else") && !IsName(t, "or") && !IsName(t, "and")) {
      if (IsName(t, "is")) FailHere("You cannot chain multiple tests with is");
      e->children.push_back(ParsePostfix(ParsePrimary()));
    }
    return e;
  }

  std::vector<Token> tokens_;
  const Positions& positions_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

bool IsKnownFilter(std::string_view name) {
  return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
}

bool IsKnownTest(std::string_view name) {
  return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
}

std::unique_ptr<Program> ParseProgram(std::string_view source) {
  // jinja2 reads \r\n and \r as \n, and (keep_trailing_newline=False) drops
  // one newline at the very end.
  std::string normalized;
  normalized.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      normalized += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      normalized += source[i];
    }
  }
  if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
  Positions positions(normalized);
  Parser parser(Lex(normalized, positions), positions);
  return parser.Run();
}

}  // namespace hearth::llm::jinja
