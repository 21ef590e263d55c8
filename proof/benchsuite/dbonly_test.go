//go:build shopbench

package benchsuite

import (
	"context"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The database-only ceiling of rows 1 and 2 is the relay's claim and mark
// with nothing published between them. pkg/outbox exports nothing for
// benchmarks, and a copy of its statements here could drift from what the
// relay runs; so the suite reads the statements themselves, the constants
// claimSQL and markSQL, from pkg/outbox's source. A rename or a change of
// their parameters fails TestDBOnlyRunsTheRelaysStatements in make test,
// not only in make bench.

// outboxDir is pkg/outbox, seen from this package's directory (where go
// test runs).
const outboxDir = "../../pkg/outbox"

// relayBatch is outbox.Config's default BatchSize, with which rows 1 and
// 2's relays run: the ceiling claims batches of the same size.
const relayBatch = 500

// relayStatements are the SQL of pkg/outbox's claim and mark.
type relayStatements struct{ claim, mark string }

// readRelayStatements returns the string constants claimSQL and markSQL of
// pkg/outbox's non-test files.
func readRelayStatements(tb testing.TB) relayStatements {
	tb.Helper()
	consts, err := stringConsts(outboxDir)
	if err != nil {
		tb.Fatal(err)
	}
	s := relayStatements{claim: consts["claimSQL"], mark: consts["markSQL"]}
	if s.claim == "" || s.mark == "" {
		tb.Fatalf("pkg/outbox declares no string constants claimSQL and markSQL (found %d constants): "+
			"the database-only ceiling must run the relay's own claim and mark; update proof/benchsuite/dbonly_test.go", len(consts))
	}
	return s
}

// stringConsts returns the string constants declared in the non-test Go
// files of dir, by name: literals, and sums of literals and of other such
// constants (claimSQL is built from dueSQL).
func stringConsts(dir string) (map[string]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, err
	}
	exprs := map[string]ast.Expr{}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, fmt.Errorf("read pkg/outbox: %w", err)
		}
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, id := range vs.Names {
					if i < len(vs.Values) {
						exprs[id.Name] = vs.Values[i]
					}
				}
			}
		}
	}
	consts := map[string]string{}
	for name := range exprs {
		if v, ok := stringValue(exprs, name, 0); ok {
			consts[name] = v
		}
	}
	return consts, nil
}

// stringValue folds the constant name to a string, if it is one.
func stringValue(exprs map[string]ast.Expr, name string, depth int) (string, bool) {
	var fold func(e ast.Expr) (string, bool)
	fold = func(e ast.Expr) (string, bool) {
		switch e := e.(type) {
		case *ast.BasicLit:
			if e.Kind != token.STRING {
				return "", false
			}
			v, err := strconv.Unquote(e.Value)
			return v, err == nil
		case *ast.Ident:
			if _, ok := exprs[e.Name]; !ok || depth > 8 {
				return "", false
			}
			return stringValue(exprs, e.Name, depth+1)
		case *ast.BinaryExpr:
			x, okx := fold(e.X)
			y, oky := fold(e.Y)
			return x + y, okx && oky && e.Op == token.ADD
		case *ast.ParenExpr:
			return fold(e.X)
		}
		return "", false
	}
	return fold(exprs[name])
}

// claimAndMark claims one batch as a relay does (lease of 15 s, the
// relay's default) and marks it published without publishing anything:
// the relay's database work alone. It returns how many events it marked.
func (s relayStatements) claimAndMark(ctx context.Context, pool *pgxpool.Pool, name string, batch int) (int, error) {
	token := uuid.New()
	rows, err := pool.Query(ctx, s.claim, batch, name, token, (15 * time.Second).Microseconds(), 0, nil)
	if err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	var ids [][16]byte
	for rows.Next() {
		// The relay reads every column of the claimed rows; so does this.
		vals, err := rows.Values()
		if err != nil {
			rows.Close()
			return 0, fmt.Errorf("claim: %w", err)
		}
		id, ok := vals[0].([16]byte)
		if !ok {
			rows.Close()
			return 0, fmt.Errorf("claim: first column is %T, want the event id", vals[0])
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("claim: %w", err)
	}
	if len(ids) == 0 {
		return 0, nil
	}
	// markSQL answers how many it marked, and how many of those have their
	// aggregate's next event waiting (which the relay then claims at once).
	var marked, waiting int64
	if err := pool.QueryRow(ctx, s.mark, ids, token).Scan(&marked, &waiting); err != nil {
		return 0, fmt.Errorf("mark: %w", err)
	}
	return int(marked), nil
}

func TestDBOnlyRunsTheRelaysStatements(t *testing.T) {
	e := newEnv(t, nil)
	fillBacklog(t, e.db.Pool, 7, false, "o-")
	s := readRelayStatements(t)
	ctx := context.Background()
	total := 0
	for range 10 {
		n, err := s.claimAndMark(ctx, e.db.Pool, "db-only", 500)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		total += n
	}
	if total != 7 {
		t.Errorf("claim and mark took %d events, want all 7", total)
	}
	var marked int
	if err := e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND claim_token IS NULL`).Scan(&marked); err != nil {
		t.Fatal(err)
	}
	if marked != 7 {
		t.Errorf("%d events marked published and released, want 7", marked)
	}
	info, err := e.stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 0 {
		t.Errorf("%d messages in the stream, want none: the database-only ceiling publishes nothing", info.State.Msgs)
	}
}
