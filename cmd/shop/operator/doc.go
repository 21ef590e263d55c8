// Package operator is the shop's operator command line, as functions that
// cmd/shop dispatches to and tests call directly:
//
//   - Outbox: shop outbox status, dead, show, requeue, replay, republish
//     --lost, dead-letters list|requeue|discard and parked list|discard — the
//     backlog of each service's outbox, and what its relay or its consumers
//     gave up on, with the ways back (requeue, replay, republish) and the
//     ways to give up for good (discard, kept for audit);
//   - Trace: shop trace <order-id>, one order's journey through every service;
//   - Verify: shop verify, the contract's invariants against the live
//     databases and streams;
//   - Migrate: shop migrate, each service's schema and, with -roles, its
//     database role.
//
// Each takes ctx, its arguments (after the command's name), the environment
// as getenv and its stdout and stderr, owns its flag set, and returns an
// error: one wrapping cli.ErrUsage for a command line it does not understand
// (it has printed why), ErrViolations when verify found the invariants
// broken (it has printed the report), flag.ErrHelp after -h has printed a
// command's flags. None exits.
package operator
