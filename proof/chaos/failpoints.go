package chaos

import (
	"bufio"
	"os"
	"regexp"
	"slices"
	"syscall"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/pkg/outbox"
)

// plan says where each failpoint is armed and on which hit it crashes.
// A failpoint missing here is armed on an order process at its first hit,
// and the run fails if that never fires.
var plan = map[string]struct {
	service string
	count   int
}{
	failpoint.OrderAfterCommitBeforeResponse:          {"order", 3},
	failpoint.SagaAfterClaimTimeout:                   {"order", 1},
	failpoint.OutboxAfterClaim:                        {"order", 4},
	failpoint.InboxBeforeCommit:                       {"inventory", 6},
	failpoint.OutboxBeforePublish:                     {"inventory", 5},
	failpoint.InboxAfterCommitBeforeAck:               {"payment", 3},
	failpoint.OutboxAfterAckBeforeMark:                {"inventory", 3},
	failpoint.PaymentWebhookAfterCommitBeforeResponse: {"payment", 2},
	failpoint.PaymentRefundAfterProviderBeforeStore:   {"payment", 1},
	failpoint.OutboxRetentionMidBatch:                 {"fulfillment", 1}, // armed on every copy
	failpoint.OutboxCDCAfterMark:                      {"payment", 3},
}

// modeOnly are the failpoints of one relay mode. A run's processes all
// relay one way (the cdc lane's stream, else the poller), and the other
// mode's failpoint is never reached: the stream claims nothing, and a
// poller confirms nothing.
var modeOnly = map[string]outbox.Mode{
	failpoint.OutboxAfterClaim:   outbox.ModePoll,
	failpoint.OutboxCDCAfterMark: outbox.ModeCDC,
}

// relayMode is how the run's processes relay.
func (c Config) relayMode() outbox.Mode {
	if c.lane(LaneCDC) {
		return outbox.ModeCDC
	}
	return outbox.ModePoll
}

// failpoints are the failpoints the run arms and expects to fire.
func (c Config) failpoints() []string {
	var names []string
	for _, n := range failpoint.Names() {
		if m, ok := modeOnly[n]; !ok || m == c.relayMode() {
			names = append(names, n)
		}
	}
	return names
}

// fpJob is one failpoint queued on a slot: its name, and the spec
// (name=crash@hit) that arms it through failpoint.EnvVar.
type fpJob struct{ name, spec string }

// arm SIGKILLs a process started clean that has failpoints queued: the
// supervisor restarts it with the first one armed.
func (s *slot) arm() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spec.spec == "" && len(s.queue) > 0 && !s.stop {
		s.signalLocked(syscall.SIGKILL)
	}
}

// dropJob removes failpoint name from the slot's queue: another copy fired
// it.
func (s *slot) dropJob(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spec.name == name {
		return // running with it: leave the process alone
	}
	s.queue = slices.DeleteFunc(s.queue, func(j fpJob) bool { return j.name == name })
}

var firedLine = regexp.MustCompile(`failpoint (\S+): crash \(hit`)

// firedIn returns the failpoint whose crash the log at path records, or ""
// when none fired.
func firedIn(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if m := firedLine.FindStringSubmatch(sc.Text()); m != nil {
			return m[1]
		}
	}
	return ""
}
