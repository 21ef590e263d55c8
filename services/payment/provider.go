package payment

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrProviderTimeout is what the fake provider returns when told to time out
// after doing the work: the caller cannot know whether the refund happened,
// which is exactly the case the idempotency key exists for.
var ErrProviderTimeout = errors.New("payment provider: request timed out (outcome unknown)")

// ErrProviderUnavailable is what the fake provider returns when told to
// fail (FailRefunds): nothing was refunded, and a retry may succeed.
var ErrProviderUnavailable = errors.New("payment provider: unavailable, nothing refunded")

// ErrKeyReused is returned when an idempotency key comes back with a
// different amount: the provider refuses rather than guess which was meant.
var ErrKeyReused = errors.New("payment provider: idempotency key reused with different parameters")

// FakeProvider stands in for a payment provider: it charges by producing
// signed webhook callbacks and refunds idempotently by key. It keeps
// everything in memory and is safe for concurrent use.
type FakeProvider struct {
	mu           sync.Mutex
	refunds      map[string]*fakeRefund // by idempotency key
	calls        int                    // Refund calls, successful or not
	timeoutAfter int                    // how many of the next refunds do the work and then time out
	down         bool                   // refunds fail without doing anything
}

type fakeRefund struct {
	id     string
	amount int64
}

// NewFakeProvider returns a provider with no refunds.
func NewFakeProvider() *FakeProvider {
	return &FakeProvider{refunds: map[string]*fakeRefund{}}
}

// Callback is the body a provider POSTs to the webhook.
type Callback struct {
	OrderID           string `json:"order_id"`
	ProviderPaymentID string `json:"provider_payment_id"`
	Status            string `json:"status"` // "succeeded" or "failed"
	Amount            int64  `json:"amount"`
}

// Charge takes (or fails to take) amount for orderID under a fresh provider
// payment id and returns the callback body with its Payment-Signature, made
// with secret at now, as a real provider would send them.
func (p *FakeProvider) Charge(orderID string, amount int64, outcome, secret string, now time.Time) (body []byte, signature string, err error) {
	body, err = json.Marshal(Callback{
		OrderID:           orderID,
		ProviderPaymentID: "pay_" + randomHex(12),
		Status:            outcome,
		Amount:            amount,
	})
	if err != nil {
		return nil, "", fmt.Errorf("encode callback: %w", err)
	}
	return body, Sign(secret, now, body), nil
}

// Refund refunds amount once per key and returns the provider's refund id.
// Calling it again with the same key returns the same id and refunds
// nothing more, however the first call ended.
func (p *FakeProvider) Refund(ctx context.Context, key string, amount int64) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.down {
		return "", ErrProviderUnavailable
	}
	r, ok := p.refunds[key]
	if !ok {
		r = &fakeRefund{id: "re_" + randomHex(12), amount: amount}
		p.refunds[key] = r
	} else if r.amount != amount {
		return "", ErrKeyReused
	}
	if p.timeoutAfter > 0 {
		// The work is done; only the answer is lost.
		p.timeoutAfter--
		return "", ErrProviderTimeout
	}
	return r.id, nil
}

// TimeoutAfterWork makes the next n Refund calls refund (when their key is
// new) and then report ErrProviderTimeout: an ambiguous result. For tests.
func (p *FakeProvider) TimeoutAfterWork(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.timeoutAfter = n
}

// SetDown makes every Refund call fail with ErrProviderUnavailable,
// refunding nothing, until it is called with false: a provider that cannot
// refund for a while. For tests.
func (p *FakeProvider) SetDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
}

// Refunds returns how many refunds the provider has made: one per key.
func (p *FakeProvider) Refunds() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.refunds)
}

// RefundCalls returns how many times Refund was called, retries included.
func (p *FakeProvider) RefundCalls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b)
}
