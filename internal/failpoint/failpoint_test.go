package failpoint

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// env is a getenv that knows only SHOP_FAILPOINTS.
func env(spec string) func(string) string {
	return func(k string) string {
		if k == EnvVar {
			return spec
		}
		return ""
	}
}

// The tests share the package's one configuration, so none runs in parallel.
func setTest(t *testing.T, spec string) {
	t.Helper()
	if err := Init(env(spec)); err != nil {
		t.Fatalf("Init(%q): %v", spec, err)
	}
	t.Cleanup(func() { active.Store(nil) })
}

func TestNames(t *testing.T) {
	want := []string{
		"inbox.after_commit_before_ack", "inbox.before_commit",
		"order.after_commit_before_response",
		"outbox.after_ack_before_mark", "outbox.after_claim", "outbox.before_publish", "outbox.cdc_after_mark", "outbox.retention_mid_batch",
		"payment.refund_after_provider_before_store", "payment.webhook_after_commit_before_response",
		"saga.after_claim_timeout",
	}
	if got := Names(); !slices.Equal(got, want) {
		t.Fatalf("Names() = %v\nwant %v", got, want)
	}
	Names()[0] = "changed"
	if Names()[0] != want[0] {
		t.Fatal("Names returns the registry itself")
	}
}

func TestOffPath(t *testing.T) {
	setTest(t, "")
	for _, n := range append(Names(), "not.a.failpoint") {
		if err := Inject(n); err != nil {
			t.Fatalf("Inject(%q) = %v with nothing configured", n, err)
		}
	}
	if Spec() != "" {
		t.Fatalf("Spec() = %q, want empty", Spec())
	}
	if allocs := testing.AllocsPerRun(100, func() { _ = Inject(OutboxAfterClaim) }); allocs != 0 {
		t.Fatalf("off path allocates %v times", allocs)
	}
}

func TestParse(t *testing.T) {
	good := []struct {
		spec  string
		name  string
		kind  kind
		count int64
		sleep time.Duration
	}{
		{"outbox.after_claim=crash", OutboxAfterClaim, kindCrash, 0, 0},
		{"outbox.after_ack_before_mark=crash@3", OutboxAfterAckBeforeMark, kindCrash, 3, 0},
		{" inbox.before_commit = error ", InboxBeforeCommit, kindError, 0, 0},
		{"saga.after_claim_timeout=sleep(250ms)@2", SagaAfterClaimTimeout, kindSleep, 2, 250 * time.Millisecond},
		{"order.after_commit_before_response=sleep(1m30s),", OrderAfterCommitBeforeResponse, kindSleep, 0, 90 * time.Second},
	}
	for _, tc := range good {
		c, err := parse(tc.spec)
		if err != nil {
			t.Fatalf("parse(%q): %v", tc.spec, err)
		}
		p := c.points[tc.name]
		if len(c.points) != 1 || p == nil || p.kind != tc.kind || p.count != tc.count || p.sleep != tc.sleep {
			t.Fatalf("parse(%q) = %+v", tc.spec, c.points)
		}
	}
	c, err := parse("outbox.after_claim=error, inbox.after_commit_before_ack=crash@2,payment.refund_after_provider_before_store=sleep(0s)")
	if err != nil || len(c.points) != 3 {
		t.Fatalf("three entries: %v %v", c, err)
	}
	if c, err := parse("  "); c != nil || err != nil {
		t.Fatalf("blank: %v %v", c, err)
	}

	bad := map[string]string{
		"outbox.after_claim":                                "not name=action",
		"=crash":                                            "not name=action",
		"outbox.after_claim=":                               "not name=action",
		"outbox.after_claim=explode":                        "unknown action",
		"outbox.after_claim=crash@0":                        "positive integer",
		"outbox.after_claim=crash@-1":                       "positive integer",
		"outbox.after_claim=crash@x":                        "positive integer",
		"outbox.after_claim=sleep(soon)":                    "duration",
		"outbox.after_claim=sleep(-1s)":                     "duration",
		"outbox.after_claim=sleep(1s":                       "unknown action",
		"outbox.after_claim=crash,outbox.after_claim=error": "configured twice",
	}
	for spec, want := range bad {
		if _, err := parse(spec); err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), EnvVar) {
			t.Errorf("parse(%q) = %v, want an error mentioning %q", spec, err, want)
		}
	}
}

func TestUnknownNameListsKnownOnes(t *testing.T) {
	setTest(t, "outbox.after_claim=error")
	err := Init(env("outbox.after_clam=crash"))
	if err == nil {
		t.Fatal("an unknown failpoint was accepted")
	}
	for _, n := range append(Names(), `"outbox.after_clam"`) {
		if !strings.Contains(err.Error(), n) {
			t.Errorf("error %q does not name %s", err, n)
		}
	}
	// A refused configuration changes nothing.
	if Spec() != "outbox.after_claim=error" || Inject(OutboxAfterClaim) == nil {
		t.Fatal("a failed Init replaced the configuration")
	}
}

func TestErrorEveryHit(t *testing.T) {
	setTest(t, "inbox.before_commit=error")
	for range 3 {
		err := Inject(InboxBeforeCommit)
		if !errors.Is(err, ErrInjected) || !strings.Contains(err.Error(), InboxBeforeCommit) {
			t.Fatalf("Inject = %v, want ErrInjected naming the point", err)
		}
	}
	if err := Inject(InboxAfterCommitBeforeAck); err != nil {
		t.Fatalf("an unconfigured point fired: %v", err)
	}
}

func TestCountFiresOnNthHitOnly(t *testing.T) {
	setTest(t, "outbox.after_ack_before_mark=error@3")
	var fired []int
	for i := 1; i <= 6; i++ {
		if Inject(OutboxAfterAckBeforeMark) != nil {
			fired = append(fired, i)
		}
	}
	if !slices.Equal(fired, []int{3}) {
		t.Fatalf("fired on hits %v, want [3]", fired)
	}
}

func TestCountUnderConcurrency(t *testing.T) {
	setTest(t, "outbox.after_claim=error@50")
	var mu sync.Mutex
	fired := 0
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			for range 20 {
				if Inject(OutboxAfterClaim) != nil {
					mu.Lock()
					fired++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if fired != 1 {
		t.Fatalf("fired %d times in 200 concurrent hits, want once", fired)
	}
}

func TestSleep(t *testing.T) {
	setTest(t, "saga.after_claim_timeout=sleep(60ms)@2")
	start := time.Now()
	if err := Inject(SagaAfterClaimTimeout); err != nil || time.Since(start) > 40*time.Millisecond {
		t.Fatalf("first hit: %v after %s; want no sleep", err, time.Since(start))
	}
	start = time.Now()
	if err := Inject(SagaAfterClaimTimeout); err != nil || time.Since(start) < 60*time.Millisecond {
		t.Fatalf("second hit: %v after %s; want a 60ms sleep and nil", err, time.Since(start))
	}
}

func TestInitReplacesAndDisarms(t *testing.T) {
	setTest(t, "outbox.after_claim=error")
	if err := Init(env("outbox.before_publish=error")); err != nil {
		t.Fatal(err)
	}
	if Inject(OutboxAfterClaim) != nil || Inject(OutboxBeforePublish) == nil {
		t.Fatal("Init did not replace the configuration")
	}
	if err := Init(env("")); err != nil || Inject(OutboxBeforePublish) != nil || Spec() != "" {
		t.Fatalf("Init with nothing did not disarm: %v", err)
	}
}

// crashHelperEnv tells the test binary, run again as a child, to be the
// process that crashes.
const crashHelperEnv = "FAILPOINT_CRASH_HELPER"

// TestCrashHelper is not a test: it is the child process of TestCrash.
func TestCrashHelper(t *testing.T) {
	if os.Getenv(crashHelperEnv) != "1" {
		t.Skip("the child process of TestCrash")
	}
	registry = append(registry, "x")
	if err := Init(env("x=crash@2")); err != nil {
		t.Fatal(err)
	}
	defer os.Stdout.WriteString("deferred function ran\n")
	if err := Inject("x"); err != nil {
		t.Fatalf("first hit: %v", err)
	}
	os.Stdout.WriteString("survived the first hit\n")
	_ = Inject("x")
	os.Stdout.WriteString("survived the crash\n")
}

func TestCrash(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashHelperEnv+"=1")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) || exitErr.ExitCode() != CrashExitCode {
		t.Fatalf("child ended with %v, want exit status %d\nstdout: %s\nstderr: %s", err, CrashExitCode, stdout.String(), stderr.String())
	}
	wantLine := "failpoint x: crash (hit 2), exiting with status 137 as if killed\n"
	if stderr.String() != wantLine {
		t.Fatalf("stderr %q, want exactly %q", stderr.String(), wantLine)
	}
	if out := stdout.String(); !strings.Contains(out, "survived the first hit") ||
		strings.Contains(out, "survived the crash") || strings.Contains(out, "deferred function ran") {
		t.Fatalf("stdout %q: want the first hit survived, then nothing (no deferred functions)", out)
	}
}

func BenchmarkInjectOff(b *testing.B) {
	active.Store(nil)
	for b.Loop() {
		_ = Inject(OutboxAfterAckBeforeMark)
	}
}

func BenchmarkInjectOtherPointArmed(b *testing.B) {
	if err := Init(env("payment.refund_after_provider_before_store=crash")); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { active.Store(nil) })
	for b.Loop() {
		_ = Inject(OutboxAfterAckBeforeMark)
	}
}
