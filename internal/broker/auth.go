package broker

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// Access is what one service does on NATS.
type Access struct {
	// User is the service's NATS user: its name ("order").
	User string
	// Stream is the stream it owns and publishes to ("ORDERS"), Subjects
	// that stream's subjects ("orders.>").
	Stream   string
	Subjects []string
	// Durables are its durable consumers on the streams it reads.
	Durables []Durable
}

// Durable is a durable pull consumer a service runs on a stream it reads.
type Durable struct {
	Stream string // "INVENTORY"
	Name   string // "order-inventory"
}

// Reads lists the streams of a's durables, each once, in order.
func (a Access) Reads() []string {
	var reads []string
	for _, d := range a.Durables {
		if !slices.Contains(reads, d.Stream) {
			reads = append(reads, d.Stream)
		}
	}
	return reads
}

// AuditUser is the operator's NATS user: `shop verify`, `shop outbox` and
// the reconciler read streams, their messages and consumer state with it,
// and it may change nothing (AuditPermissions).
const AuditUser = "audit"

// StreamsUser is the NATS user of the stream keeper: the one user that may
// create or update the shop's streams, to hold them to their table
// configuration (StreamConfig). A process given its password
// (PasswordVar(StreamsUser), STREAMS_NATS_PASSWORD: the order service's in
// docker-compose.yml, and `shop all`'s embedded server) creates the
// missing streams and restores any whose configuration drifted; every
// other process waits for its streams and reports their drift.
const StreamsUser = "streams"

// SystemUsers are the shop's NATS users besides one per service. A service
// named like one of them would share its user (registry.Validate refuses
// the name; Users refuses two users of one name).
func SystemUsers() []string { return []string{AuditUser, StreamsUser} }

// denied is what no shop user may do, even where an allow would match:
// removing a stream or its messages is an operator's act on the server
// itself.
var denied = []string{"$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>"}

// reconfigure is what no service may do to any stream, its own included:
// change its configuration. Its own stream's update was allowed once, and
// one service's credentials were enough to make a stream a weapon: RePublish
// on INVENTORY stored inventory's messages in ORDERS, and AllowRollup on
// ORDERS let one message with `Nats-Rollup: all` remove 26,938 of its 26,939
// messages; a restart kept the tampered configuration. Only StreamsUser
// updates streams, to the shop's configuration.
const reconfigure = "$JS.API.STREAM.UPDATE.>"

// create is what no service may do to any stream: create one. nats-server
// does not check the configuration a stream is created with, so a missing
// stream was a weapon for whoever created it first: on an empty store the
// payment user created PAYMENT in memory, republishing payment.forge.>
// into orders.>, and the keeper could not restore it (no update changes a
// stream's storage). Only StreamsUser creates streams, with StreamConfig.
const create = "$JS.API.STREAM.CREATE.>"

// Permissions are a's NATS permissions. Publish: its own subjects; of the
// JetStream API, account info and stream lookup by subject (the relay's
// outage checks), info of its own stream and of the streams it reads (it
// waits for them, and compares their configuration with the shop's), info
// of the consumers on its own stream (the order service's admission reads
// their backlog), and create, info, next and ack of its own durables. No
// create or update of any stream, its own included (denied explicitly, see
// create and reconfigure): that is the stream keeper's (StreamsUser).
// Subscribe: its own reply subjects only (InboxPrefix(user).>), where pull
// consumers, publish acks and API answers arrive: not the others', which
// would show it their messages.
func Permissions(a Access) *server.Permissions {
	pub := slices.Clone(a.Subjects)
	pub = append(pub, "$JS.API.INFO", "$JS.API.STREAM.NAMES")
	pub = append(pub, "$JS.API.STREAM.INFO."+a.Stream)
	// The backlog of its own events (the order service's admission reads it).
	pub = append(pub, "$JS.API.CONSUMER.INFO."+a.Stream+".*")
	for _, s := range a.Reads() {
		pub = append(pub, "$JS.API.STREAM.INFO."+s)
	}
	for _, d := range a.Durables {
		sn := d.Stream + "." + d.Name
		pub = append(pub,
			"$JS.API.CONSUMER.CREATE."+sn,         // nats.go ≥ 1.30, several filter subjects
			"$JS.API.CONSUMER.CREATE."+sn+".>",    // one filter subject
			"$JS.API.CONSUMER.DURABLE.CREATE."+sn, // older clients
			"$JS.API.CONSUMER.INFO."+sn,
			"$JS.API.CONSUMER.MSG.NEXT."+sn,
			"$JS.ACK."+sn+".>")
	}
	return &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: pub, Deny: append(slices.Clone(denied), reconfigure, create)},
		Subscribe: &server.SubjectPermission{Allow: []string{InboxPrefix(a.User) + ".>"}},
	}
}

// AuditPermissions are the audit user's: JetStream API reads and nothing
// else. Account info; stream names, list and info; stream messages by
// sequence or time, through direct get (the stream audit reads in batches,
// from any replica) or the stream leader's message get; consumer names,
// list and info (backlogs, `shop outbox status`). It creates no consumer —
// not even an ephemeral ordered one, which a reader would leave on the
// server for seconds with the rest of the window as its pending count —
// deletes none, and publishes into no stream. The denies say so explicitly,
// so that a wider allow added later cannot undo it.
func AuditPermissions() *server.Permissions {
	return &server.Permissions{
		Publish: &server.SubjectPermission{Allow: []string{
			"$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
			"$JS.API.STREAM.INFO.*", "$JS.API.STREAM.MSG.GET.*", "$JS.API.DIRECT.GET.>",
			"$JS.API.CONSUMER.NAMES.*", "$JS.API.CONSUMER.LIST.*", "$JS.API.CONSUMER.INFO.*.*",
		}, Deny: append(slices.Clone(denied), reconfigure, create,
			"$JS.API.CONSUMER.CREATE.>", "$JS.API.CONSUMER.DURABLE.CREATE.>", "$JS.API.CONSUMER.DELETE.>",
			"$JS.API.CONSUMER.MSG.NEXT.>", "$JS.ACK.>",
		)},
		Subscribe: &server.SubjectPermission{Allow: []string{InboxPrefix(AuditUser) + ".>"}},
	}
}

// StreamsPermissions are the stream keeper's: account info, stream names,
// and info, create, update and delete of each stream of services, and
// nothing else. Create: the keeper is the only user that makes a stream,
// with the shop's configuration. Delete: a stream whose configuration no
// update can restore (its storage, a mirror) and that holds no message is
// deleted and created again by the keeper (cmd/shop/app's streamkeeper.go
// says why that loses nothing). It publishes no message, reads none,
// touches no consumer, and may purge nothing: the keeper's password in the
// wrong hands can remove a stream, as it could already shorten its MaxAge
// by an update; what a stream loses that way the outboxes still hold
// within their retention, and the reconciler's stream audit resends it.
func StreamsPermissions(services []Access) *server.Permissions {
	pub := []string{"$JS.API.INFO", "$JS.API.STREAM.NAMES"}
	for _, s := range streamNames(services) {
		pub = append(pub, "$JS.API.STREAM.INFO."+s, "$JS.API.STREAM.CREATE."+s, "$JS.API.STREAM.UPDATE."+s, "$JS.API.STREAM.DELETE."+s)
	}
	return &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: pub, Deny: []string{"$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>"}},
		Subscribe: &server.SubjectPermission{Allow: []string{InboxPrefix(StreamsUser) + ".>"}},
	}
}

// streamNames are the streams of services, each once, in order: those they
// own, then any they read that none of them owns.
func streamNames(services []Access) []string {
	var names []string
	for _, a := range services {
		names = append(names, a.Stream)
	}
	for _, a := range services {
		for _, s := range a.Reads() {
			if !slices.Contains(names, s) {
				names = append(names, s)
			}
		}
	}
	return names
}

// InboxPrefix is the prefix of user's reply subjects ("_INBOX.order"), the
// only subjects it may subscribe to. A client of the user must connect with
// it (UserOptions): under nats.go's default, _INBOX.<random>, every reply
// would be refused.
func InboxPrefix(user string) string { return "_INBOX." + user }

// UserOptions are the options to connect as user: its password (none:
// anonymous) and its reply subjects under InboxPrefix(user).
func UserOptions(user, password string) []nats.Option {
	opts := []nats.Option{nats.CustomInboxPrefix(InboxPrefix(user))}
	if password != "" {
		opts = append(opts, nats.UserInfo(user, password))
	}
	return opts
}

// Users are the nats-server users of services, the audit user and the
// stream keeper, with the passwords by user name (every one must be
// there).
func Users(services []Access, passwords map[string]string) ([]*server.User, error) {
	users := make([]*server.User, 0, len(services)+2)
	for _, a := range services {
		users = append(users, &server.User{Username: a.User, Password: passwords[a.User], Permissions: Permissions(a)})
	}
	users = append(users,
		&server.User{Username: AuditUser, Password: passwords[AuditUser], Permissions: AuditPermissions()},
		&server.User{Username: StreamsUser, Password: passwords[StreamsUser], Permissions: StreamsPermissions(services)})
	seen := make(map[string]bool, len(users))
	for _, u := range users {
		if u.Password == "" {
			return nil, fmt.Errorf("nats users: no password for %s", u.Username)
		}
		if seen[u.Username] {
			return nil, fmt.Errorf("nats users: two users named %s (a service named like one of the shop's own users?)", u.Username)
		}
		seen[u.Username] = true
	}
	return users, nil
}

// WithUsers makes the server require one of users on every connection: an
// anonymous client, or one with a wrong password, is refused.
func WithUsers(users []*server.User) Option {
	return func(o *server.Options) { o.Users = users }
}

// PasswordVar is the environment variable that holds user's password in
// deploy/nats/auth.conf and in the shop's processes: ORDER_NATS_PASSWORD,
// …, AUDIT_NATS_PASSWORD, STREAMS_NATS_PASSWORD.
func PasswordVar(user string) string { return strings.ToUpper(user) + "_NATS_PASSWORD" }

// AuthConfig renders the users of services, the audit user and the stream
// keeper as nats-server configuration (an authorization block), each password as password(user), a value of
// nats-server's syntax: deploy/nats/auth.conf passes "$" + PasswordVar(user),
// which the server reads from its environment; the chaos test passes the
// passwords themselves, quoted.
//
// extra users (a test harness's own) are rendered after the shop's, each
// with its password quoted and its permissions (none: every permission).
func AuthConfig(services []Access, password func(user string) string, extra ...*server.User) string {
	var b strings.Builder
	b.WriteString("authorization {\n  users = [\n")
	user := func(name, password string, p *server.Permissions) {
		fmt.Fprintf(&b, "    {\n      user: %s\n      password: %s\n", name, password)
		if p == nil {
			b.WriteString("    }\n")
			return
		}
		b.WriteString("      permissions: {\n")
		subjects := func(kind string, sp *server.SubjectPermission) {
			fmt.Fprintf(&b, "        %s: {\n", kind)
			list := func(key string, subs []string) {
				if len(subs) == 0 {
					return
				}
				fmt.Fprintf(&b, "          %s: [\n", key)
				for _, s := range subs {
					fmt.Fprintf(&b, "            %q\n", s)
				}
				b.WriteString("          ]\n")
			}
			list("allow", sp.Allow)
			list("deny", sp.Deny)
			b.WriteString("        }\n")
		}
		subjects("publish", p.Publish)
		subjects("subscribe", p.Subscribe)
		b.WriteString("      }\n    }\n")
	}
	for _, a := range services {
		user(a.User, password(a.User), Permissions(a))
	}
	user(AuditUser, password(AuditUser), AuditPermissions())
	user(StreamsUser, password(StreamsUser), StreamsPermissions(services))
	for _, u := range extra {
		user(u.Username, strconv.Quote(u.Password), u.Permissions)
	}
	b.WriteString("  ]\n}\n")
	return b.String()
}
