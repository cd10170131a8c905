#include "server/local_peer.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

#include "hearth/unique_fd.h"

namespace hearth {
namespace {

using Address = std::array<uint8_t, 16>;  // IPv6, IPv4 as ::ffff:a.b.c.d

std::optional<Address> ParseAddress(const std::string& text) {
  Address a{};
  in_addr v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4) == 1) {
    a[10] = a[11] = 0xff;
    std::memcpy(a.data() + 12, &v4, 4);
    return a;
  }
  if (::inet_pton(AF_INET6, text.c_str(), a.data()) == 1) return a;
  return std::nullopt;
}

Address FromDiag(uint8_t family, const __be32* words) {
  Address a{};
  if (family == AF_INET) {
    a[10] = a[11] = 0xff;
    std::memcpy(a.data() + 12, words, 4);
  } else {
    std::memcpy(a.data(), words, 16);
  }
  return a;
}

// Sockets in these states have a user; a request socket (SYN_RECV) or a
// TIME_WAIT one reports uid 0, whoever made it.
constexpr uint32_t kStates = (1u << TCP_ESTABLISHED) | (1u << TCP_FIN_WAIT1) |
                             (1u << TCP_FIN_WAIT2) | (1u << TCP_CLOSE_WAIT) | (1u << TCP_CLOSING) |
                             (1u << TCP_LAST_ACK);

// One dump request for `family`, filtered in the kernel to sockets whose
// source port is `sport` and destination port `dport` (inet_diag's
// bytecode: each op jumps `yes` bytes on a match, `no` bytes otherwise; a
// run that ends exactly at the end accepts, one past it rejects).
struct DumpRequest {
  nlmsghdr header;
  inet_diag_req_v2 request;
  nlattr filter;
  inet_diag_bc_op ops[4];
};

DumpRequest MakeDump(uint8_t family, uint16_t sport, uint16_t dport, uint32_t seq) {
  DumpRequest r{};
  r.header.nlmsg_len = sizeof(r);
  r.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  r.header.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  r.header.nlmsg_seq = seq;
  r.request.sdiag_family = family;
  r.request.sdiag_protocol = IPPROTO_TCP;
  r.request.idiag_states = kStates;
  r.filter.nla_type = INET_DIAG_REQ_BYTECODE;
  r.filter.nla_len = static_cast<uint16_t>(NLA_HDRLEN + sizeof(r.ops));
  constexpr uint16_t kLen = sizeof(r.ops);
  r.ops[0] = {INET_DIAG_BC_S_EQ, 8, kLen + 4};
  r.ops[1] = {0, 0, sport};
  r.ops[2] = {INET_DIAG_BC_D_EQ, 8, kLen - 8 + 4};
  r.ops[3] = {0, 0, dport};
  return r;
}
static_assert(sizeof(DumpRequest) ==
                  NLMSG_LENGTH(sizeof(inet_diag_req_v2)) + NLA_HDRLEN + 4 * sizeof(inet_diag_bc_op),
              "the netlink request is one message with one attribute, unpadded");

// Adds the user of every socket of `family` from `client` (its address and
// port) to `server_port`.
Status Dump(int fd, uint8_t family, const Address& client, uint16_t client_port,
            uint16_t server_port, uint32_t seq, std::set<uid_t>* uids) {
  DumpRequest request = MakeDump(family, client_port, server_port, seq);
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd, &request, sizeof(request), 0, reinterpret_cast<sockaddr*>(&kernel),
               sizeof(kernel)) != static_cast<ssize_t>(sizeof(request)))
    return ErrnoError("sock_diag: sending the request", errno);
  alignas(nlmsghdr) std::array<char, 32768> buffer;
  for (;;) {
    sockaddr_nl from{};
    socklen_t from_length = sizeof(from);
    const ssize_t n = ::recvfrom(fd, buffer.data(), buffer.size(), 0,
                                 reinterpret_cast<sockaddr*>(&from), &from_length);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("sock_diag: reading the answer", errno);
    }
    // Only the kernel's answer counts: a datagram another process managed to
    // send here could name any uid.
    if (from.nl_family != AF_NETLINK || from.nl_pid != 0) continue;
    int left = static_cast<int>(n);
    for (auto* h = reinterpret_cast<nlmsghdr*>(buffer.data()); NLMSG_OK(h, left);
         h = NLMSG_NEXT(h, left)) {
      if (h->nlmsg_seq != seq) continue;
      if (h->nlmsg_type == NLMSG_DONE) return Status::Ok();
      if (h->nlmsg_type == NLMSG_ERROR) {
        const auto* e = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
        if (h->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr)))
          return Internal("sock_diag: short error");
        return ErrnoError("sock_diag", -e->error);
      }
      if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY ||
          h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg)))
        continue;
      const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
      if (ntohs(m->id.idiag_sport) != client_port || ntohs(m->id.idiag_dport) != server_port ||
          FromDiag(m->idiag_family, m->id.idiag_src) != client)
        continue;
      uids->insert(static_cast<uid_t>(m->idiag_uid));
    }
    if (n == 0) return Internal("sock_diag: the answer ended early");
  }
}

std::string Describe(const ClientConnection& c) {
  return (c.address.empty() ? std::string("an unknown address") : c.address) + " port " +
         std::to_string(c.port) + " (to port " + std::to_string(c.server_port) + ")";
}

}  // namespace

Result<uid_t> LocalPeerUid(const ClientConnection& connection) {
  const std::optional<Address> client = ParseAddress(connection.address);
  if (!client || connection.port == 0 || connection.server_port == 0)
    return PermissionDenied("the client's connection (" + Describe(connection) +
                            ") is not a TCP connection from this machine");
  UniqueFd fd(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (!fd.valid()) return ErrnoError("sock_diag: socket", errno);
  // The kernel answers at once; a bound keeps a caller's thread from waiting
  // on it forever whatever happens.
  const timeval limit{2, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  std::set<uid_t> uids;
  // An IPv4 client may have an IPv6 socket (::ffff:a.b.c.d) and the other
  // way round: ask both families.
  RETURN_IF_ERROR(
      Dump(fd.get(), AF_INET, *client, connection.port, connection.server_port, 1, &uids));
  RETURN_IF_ERROR(
      Dump(fd.get(), AF_INET6, *client, connection.port, connection.server_port, 2, &uids));
  if (uids.empty())
    return PermissionDenied("the client's connection (" + Describe(connection) +
                            ") does not come from a process on this machine");
  if (uids.size() > 1)
    return PermissionDenied("the client's connection (" + Describe(connection) +
                            ") matches sockets of several users on this machine");
  return *uids.begin();
}

}  // namespace hearth
