// Package broker holds the NATS plumbing shared by the services, the demo and
// the tests: an embedded JetStream server and the streams of the contract.
package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
)

// Embedded starts a NATS server with JetStream inside this process, listening
// on host:port (port -1 picks a free one) and storing streams under storeDir.
func Embedded(host string, port int, storeDir string) (*server.Server, error) {
	s, err := server.NewServer(&server.Options{
		Host:      host,
		Port:      port,
		JetStream: true,
		StoreDir:  storeDir,
		NoSigs:    true,
		NoLog:     true,
	})
	if err != nil {
		return nil, fmt.Errorf("embedded nats: %w", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, errors.New("embedded nats: not ready after 10s")
	}
	return s, nil
}

// DuplicateWindow is how long JetStream remembers a Nats-Msg-Id and drops a
// second copy. The relay republishes an event it could not mark published
// well within it; consumers' inboxes absorb copies that arrive later.
const DuplicateWindow = 10 * time.Minute

// EnsureStream creates the stream of one producing service, or updates it to
// this configuration: file storage, limits retention (messages stay after
// they are consumed, so any consumer can replay), the duplicate window, and
// replicas copies (1 on a single server; 3 on a three-node cluster, so the
// stream survives the loss of a node; durable consumers inherit it).
func EnsureStream(ctx context.Context, js jetstream.JetStream, name string, replicas int, subjects ...string) (jetstream.Stream, error) {
	want := jetstream.StreamConfig{
		Name:       name,
		Subjects:   subjects,
		Storage:    jetstream.FileStorage,
		Retention:  jetstream.LimitsPolicy,
		Duplicates: DuplicateWindow,
		Replicas:   max(replicas, 1),
	}
	// Look first and change only what differs: every service ensures every
	// stream at start-up, and an update of a stream while another process
	// creates a consumer on it is needless churn (nats-server 2.15 even races
	// on it internally).
	st, err := js.Stream(ctx, name)
	switch {
	case err == nil && sameStream(st.CachedInfo().Config, want):
		return st, nil
	case err == nil:
		st, err = js.UpdateStream(ctx, want)
	case errors.Is(err, jetstream.ErrStreamNotFound):
		st, err = js.CreateStream(ctx, want)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return EnsureStream(ctx, js, name, replicas, subjects...) // another process created it just now
		}
	}
	if err != nil {
		return nil, fmt.Errorf("ensure stream %s: %w", name, err)
	}
	return st, nil
}

func sameStream(have, want jetstream.StreamConfig) bool {
	return slices.Equal(have.Subjects, want.Subjects) && have.Storage == want.Storage &&
		have.Retention == want.Retention && have.Duplicates == want.Duplicates && have.Replicas == want.Replicas
}
