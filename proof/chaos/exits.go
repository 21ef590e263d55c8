package chaos

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// Exit is a process's exit that nobody caused: neither a signal of the
// harness nor a failpoint.
type Exit struct {
	Who    string // order-1, or nats n2
	Gen    int    // which start of it (its log is <who>-<gen>.log)
	At     time.Time
	Status string // what wait reported: "exit status 1"
	Tail   string // the last lines of its log
}

// tail returns the last n lines of the file at path, each cut at 400
// bytes.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	lines = lines[max(0, len(lines)-n):]
	for i, l := range lines {
		if len(l) > 400 {
			lines[i] = l[:400] + "…"
		}
	}
	return strings.Join(lines, "\n")
}

// Cause is what the process said last: cmd/shop's final error line
// ("shop: …"), else its last log line.
func (e Exit) Cause() string {
	lines := strings.Split(e.Tail, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], "shop: ") {
			return lines[i]
		}
	}
	return lines[len(lines)-1]
}

// pgFull counts the exits whose cause is a Postgres server out of
// connections.
func pgFull(exits []Exit) int {
	n := 0
	for _, e := range exits {
		if strings.Contains(e.Cause(), "SQLSTATE 53300") {
			n++
		}
	}
	return n
}

// writeExits groups exits by their cause and prints, for each cause, who
// exited and the end of the first one's log.
func writeExits(out io.Writer, what string, exits []Exit, offset func(time.Time) time.Duration) {
	var causes []string
	by := map[string][]Exit{}
	for _, e := range exits {
		c := e.Cause()
		if by[c] == nil {
			causes = append(causes, c)
		}
		by[c] = append(by[c], e)
	}
	for _, c := range causes {
		es := by[c]
		who := make([]string, len(es))
		for i, e := range es {
			who[i] = fmt.Sprintf("%s#%d at +%v", e.Who, e.Gen, offset(e.At))
		}
		fmt.Fprintf(out, "\n%s that exited on their own ×%d with %q (%s): %s; the log of the first ends:\n%s\n",
			what, len(es), c, es[0].Status, strings.Join(who, ", "), es[0].Tail)
	}
}
