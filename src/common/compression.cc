#include "common/compression.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <limits>
#include <new>

namespace hearth {
namespace {

// windowBits: gzip's wrapper (16 + 15) or zlib's (15).
int WindowBits(BodyCoding coding) { return coding == BodyCoding::kGzip ? 15 + 16 : 15; }

const char* Name(BodyCoding coding) { return coding == BodyCoding::kGzip ? "gzip" : "deflate"; }

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

// Owns one inflate stream.
class Inflater {
 public:
  explicit Inflater(BodyCoding coding) { ok_ = inflateInit2(&stream_, WindowBits(coding)) == Z_OK; }
  ~Inflater() {
    if (ok_) inflateEnd(&stream_);
  }
  Inflater(const Inflater&) = delete;
  Inflater& operator=(const Inflater&) = delete;
  bool ok() const { return ok_; }
  z_stream& stream() { return stream_; }

 private:
  z_stream stream_{};
  bool ok_ = false;
};

// Runs inflate over `body`; `sink(out, n)` receives each piece and returns
// false to stop (over a limit). Returns the total inflated.
template <typename Sink>
Result<uint64_t> Run(std::string_view body, BodyCoding coding, std::string_view subject,
                     Sink&& sink) {
  Inflater inflater(coding);
  if (!inflater.ok()) {
    return ResourceExhausted("cannot start zlib to inflate " + std::string(subject));
  }
  z_stream& s = inflater.stream();
  std::array<unsigned char, 64 * 1024> out;
  uint64_t total = 0;
  size_t fed = 0;
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    if (s.avail_in == 0 && fed < body.size()) {
      const size_t n = std::min<size_t>(body.size() - fed, std::numeric_limits<uInt>::max());
      s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(body.data() + fed));
      s.avail_in = static_cast<uInt>(n);
      fed += n;
    }
    s.next_out = out.data();
    s.avail_out = static_cast<uInt>(out.size());
    rc = inflate(&s, Z_NO_FLUSH);
    if (rc == Z_BUF_ERROR && s.avail_in == 0 && fed == body.size()) {
      return InvalidArgument(std::string(subject) + " is not complete " + Name(coding) +
                             " data: it ends early");
    }
    if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) {
      return InvalidArgument(std::string(subject) + " is not valid " + Name(coding) + " data: " +
                             (s.msg != nullptr ? s.msg : "zlib error " + std::to_string(rc)));
    }
    const size_t n = out.size() - s.avail_out;
    total += n;
    if (!sink(out.data(), n, total)) return ResourceExhausted("over the limit");
  }
  if (s.avail_in != 0 || fed != body.size()) {
    return InvalidArgument(std::string(subject) + " has bytes after its " + Name(coding) + " data");
  }
  return total;
}

}  // namespace

std::optional<BodyCoding> ParseContentEncoding(std::string_view value) {
  const std::string coding = Lower(Trim(value));
  if (coding.empty() || coding == "identity") return BodyCoding::kIdentity;
  if (coding == "gzip" || coding == "x-gzip") return BodyCoding::kGzip;
  if (coding == "deflate") return BodyCoding::kDeflate;
  return std::nullopt;
}

BodyCoding ChooseResponseCoding(std::string_view accept_encoding) {
  bool gzip = false;
  bool deflate = false;
  const std::string header = Lower(accept_encoding);
  std::string_view rest = header;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    std::string_view name = Trim(item.substr(0, item.find(';')));
    bool refused = false;
    if (const size_t q = item.find("q="); q != std::string_view::npos) {
      const std::string_view weight = Trim(item.substr(q + 2));
      refused = !weight.empty() && weight.find_first_not_of("0.") == std::string_view::npos;
    }
    if (refused) continue;
    if (name == "gzip" || name == "x-gzip") gzip = true;
    if (name == "deflate") deflate = true;
  }
  return gzip ? BodyCoding::kGzip : deflate ? BodyCoding::kDeflate : BodyCoding::kIdentity;
}

Result<uint64_t> InflatedSize(std::string_view body, BodyCoding coding, uint64_t limit,
                              std::string_view subject) {
  return Run(body, coding, subject,
             [limit](const unsigned char*, size_t, uint64_t total) { return total <= limit; });
}

Result<std::string> Inflate(std::string_view body, BodyCoding coding, uint64_t size, size_t padding,
                            std::string_view subject) {
  try {
    std::string out;
    out.reserve(static_cast<size_t>(size) + padding);
    Result<uint64_t> total = Run(body, coding, subject,
                                 [&out, size](const unsigned char* bytes, size_t n, uint64_t sum) {
                                   if (sum > size) return false;
                                   out.append(reinterpret_cast<const char*>(bytes), n);
                                   return true;
                                 });
    if (!total.ok()) return total.status();
    return out;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory inflating " + std::string(subject));
  }
}

Result<std::string> Deflate(std::string_view body, BodyCoding coding) {
  z_stream s{};
  if (deflateInit2(&s, Z_DEFAULT_COMPRESSION, Z_DEFLATED, WindowBits(coding), 8,
                   Z_DEFAULT_STRATEGY) != Z_OK) {
    return ResourceExhausted("cannot start zlib to compress the response");
  }
  struct End {
    z_stream* s;
    ~End() { deflateEnd(s); }
  } end{&s};
  try {
    std::string out(deflateBound(&s, static_cast<uLong>(body.size())), '\0');
    s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(body.data()));
    s.avail_in = static_cast<uInt>(body.size());
    s.next_out = reinterpret_cast<Bytef*>(out.data());
    s.avail_out = static_cast<uInt>(out.size());
    if (deflate(&s, Z_FINISH) != Z_STREAM_END)
      return Internal("zlib could not compress the response");
    out.resize(out.size() - s.avail_out);
    return out;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory compressing the response");
  }
}

}  // namespace hearth
