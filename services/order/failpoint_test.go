package order

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shop-ref/shop/internal/failpoint"
	"github.com/shop-ref/shop/internal/registry"
	"github.com/shop-ref/shop/pkg/outbox/outboxtest"
	"github.com/shop-ref/shop/proof/poll"
)

func TestFailpointAfterCommitBeforeResponse(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	e := setupWith(t, Config{}, registry.Hooks{FailpointFunc: func(name string) error {
		if name == failpoint.OrderAfterCommitBeforeResponse && hits.Add(1) == 1 {
			return fmt.Errorf("failpoint %s: %w", name, failpoint.ErrInjected)
		}
		return nil
	}})
	e.stock(t, "SKU-1", 250)
	body := `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":4}]}`

	// A client of its own without keep-alives: net/http retries a request
	// carrying an Idempotency-Key by itself when a reused connection breaks,
	// which would hide the lost response from the test.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	post := func() (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, e.url+"/orders", bytes.NewReader([]byte(body)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "lost-response")
		return client.Do(req)
	}
	// The order commits and the response is lost: the client sees the
	// connection drop.
	if res, err := post(); err == nil {
		res.Body.Close()
		t.Fatalf("got a response (%d) through the failpoint; want the connection dropped", res.StatusCode)
	}
	if n := e.count(t, `SELECT count(*) FROM orders`); n != 1 {
		t.Fatalf("%d orders after the lost response, want the 1 committed", n)
	}

	// The client retries with the same key and gets the order it created.
	res, err := post()
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusCreated || res.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d replayed=%q %s", res.StatusCode, res.Header.Get("Idempotent-Replayed"), b)
	}
	o := decode[Order](t, b)
	if got := e.get(t, o.ID); got.ID != o.ID || got.Total != 1000 {
		t.Fatalf("retry returned order %+v, stored %+v", o, got)
	}
	if n := e.count(t, `SELECT count(*) FROM orders`); n != 1 {
		t.Fatalf("%d orders after the retry, want 1", n)
	}
	if n := len(outboxtest.Written(t, e.pool, outboxtest.Want{Type: "OrderCreated"})); n != 1 {
		t.Fatalf("%d OrderCreated events, want 1", n)
	}
}

// TestFailpointFuncReachesConsumersAndScanner checks that Config's hook is
// handed to the service's inbox consumers and saga scanner.
func TestFailpointFuncReachesConsumersAndScanner(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	seen := map[string]int{}
	e := setupWith(t, Config{PaymentTimeout: 50 * time.Millisecond, PaymentOverdue: time.Millisecond}, registry.Hooks{FailpointFunc: func(name string) error {
		mu.Lock()
		defer mu.Unlock()
		seen[name]++
		return nil
	}})
	e.stock(t, "SKU-1", 100)
	res := e.post(t, "k", `{"customer_id":"c-1","items":[{"sku":"SKU-1","quantity":1}]}`)
	if res.status != http.StatusCreated {
		t.Fatalf("%d %s", res.status, res.body)
	}
	o := decode[Order](t, res.body)
	e.payable(t, o.ID, false)
	poll.Until(t, 15*time.Second, "every failpoint of the service to be passed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return seen[failpoint.InboxBeforeCommit] > 0 && seen[failpoint.InboxAfterCommitBeforeAck] > 0 &&
			seen[failpoint.SagaAfterClaimTimeout] > 0 && seen[failpoint.OrderAfterCommitBeforeResponse] == 1
	})
}
