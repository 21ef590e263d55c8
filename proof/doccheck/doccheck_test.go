// Package doccheck holds the Markdown to the code and files it points at:
// a document that names a file, a function in it, a package's identifier,
// a test or another document's heading makes a promise, and code moves.
// Every *.md of the module is read (node_modules, hidden and testdata
// directories aside). docs/performance-history.md is a record of
// earlier versions and names code as it was then: only its links and its
// words are held to the rules.
package doccheck

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

const root = "../.."

// history names old code on purpose; rules about code skip it.
const history = "docs/performance-history.md"

var (
	// `pkg/outbox/steps.go:settle`, `steps.go:settle`, `outbox.go:Writer.Queue`,
	// `pkg/*/example_test.go`
	fileRef = regexp.MustCompile("`((?:[a-z0-9_*]+/)*[a-z0-9_]+\\.go)(?::([A-Za-z_][A-Za-z0-9_.]*))?")
	// `TestAdd/commit leaves…`, `FuzzEnvelope`, `pkg/inbox: TestStored`
	testRef = regexp.MustCompile("`(?:((?:[a-z0-9_]+/)*[a-z0-9_]+): )?((?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*)")
	// a test named in a code block: `go test -run TestX ./…`
	bareTest = regexp.MustCompile(`\b((?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*)`)
	// an inline code span
	codeSpan = regexp.MustCompile("`[^`\n]+`")
	// `verify.ConsumedTypes`, `inbox.Config.Handles`, `pkg/outbox.Config.Hooks`,
	// `outbox.DropSlot(…)`: the whole span is the reference.
	identRef = regexp.MustCompile(`^((?:[a-z0-9_]+/)*)([a-z][a-z0-9]*)\.([A-Za-z][A-Za-z0-9]*)(?:\.([A-Za-z][A-Za-z0-9]*))?(?:\(.*\))?$`)
	// `pkg/outbox`, `services/loyalty/`: a directory a bare file name may be in
	dirRef   = regexp.MustCompile("`((?:[a-z0-9_]+/)+[a-z0-9_]*)`")
	listItem = regexp.MustCompile(`^\s*(?:[-*]|[0-9]+\.) `)
	// [text](target), [text](target "title")
	link = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
)

// notIdents are what follows a package-like word in file names and
// subjects, never a Go identifier.
var notIdents = map[string]bool{"go": true, "js": true, "css": true, "sql": true, "yaml": true, "yml": true, "json": true, "md": true, "conf": true, "html": true, "txt": true, "sh": true, "env": true, "mod": true, "sum": true}

// document is one Markdown file, by line, with the lines inside fenced
// code blocks marked.
type document struct {
	path  string // from the module root, slash-separated
	lines []string
	fence []bool
}

// units are the spans a bare file name is resolved in: a table row, a list
// item, or a paragraph (consecutive lines up to a blank line, a heading or
// a table).
func (d document) units() [][2]int {
	var out [][2]int
	start := -1
	flush := func(end int) {
		if start >= 0 {
			out = append(out, [2]int{start, end})
			start = -1
		}
	}
	for i, l := range d.lines {
		switch {
		case d.fence[i] || strings.TrimSpace(l) == "" || strings.HasPrefix(l, "#"):
			flush(i)
		case strings.HasPrefix(l, "|"):
			flush(i)
			out = append(out, [2]int{i, i + 1})
		case listItem.MatchString(l):
			flush(i)
			start = i
		default:
			if start < 0 {
				start = i
			}
		}
	}
	flush(len(d.lines))
	return out
}

func readDocs(t *testing.T) []document {
	t.Helper()
	var docs []document
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (d.Name() == "node_modules" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".md") {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		doc := document{path: filepath.ToSlash(rel)}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		s := bufio.NewScanner(f)
		s.Buffer(make([]byte, 1<<20), 1<<20)
		in := false
		for s.Scan() {
			l := s.Text()
			isFence := strings.HasPrefix(strings.TrimSpace(l), "```")
			doc.lines = append(doc.lines, l)
			doc.fence = append(doc.fence, in || isFence)
			if isFence {
				in = !in
			}
		}
		if err := s.Err(); err != nil {
			return err
		}
		docs = append(docs, doc)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) < 5 {
		t.Fatalf("found %d Markdown files under %s: the walk is wrong", len(docs), root)
	}
	return docs
}

// planned are files a document has its reader create: the guide's example
// service, which services/fifth_test.go runs in their place.
var planned = map[string]string{"docs/adding-a-service.md": "services/loyalty/"}

// TestFileReferencesResolve checks every backticked Go file a document
// names: the file exists, and `file.go:Name` or `file.go:Type.Member` is
// declared in it. A bare file name must exist in a directory the same row,
// list item or paragraph names (`pkg/outbox/steps.go`, or `pkg/outbox`
// alone), or in the document's own directory.
func TestFileReferencesResolve(t *testing.T) {
	for _, d := range readDocs(t) {
		if d.path == history {
			continue
		}
		for _, u := range d.units() {
			dirs := []string{filepath.Dir(d.path)}
			for i := u[0]; i < u[1]; i++ {
				for _, m := range fileRef.FindAllStringSubmatch(d.lines[i], -1) {
					if strings.Contains(m[1], "/") && !strings.Contains(m[1], "*") {
						dirs = append(dirs, filepath.Dir(m[1]))
					}
				}
				for _, m := range dirRef.FindAllStringSubmatch(d.lines[i], -1) {
					dirs = append(dirs, strings.TrimSuffix(m[1], "/"))
				}
			}
			for i := u[0]; i < u[1]; i++ {
				for _, m := range fileRef.FindAllStringSubmatch(d.lines[i], -1) {
					path := findFile(m[1], dirs)
					if path == "" && isPlanned(d.path, m[1], dirs) {
						continue
					}
					if path == "" {
						t.Errorf("%s:%d names %s, which does not exist (a bare name must be in a directory the same row or paragraph names)", d.path, i+1, m[1])
						continue
					}
					if m[2] == "" {
						continue
					}
					decl, err := parseFiles(filepath.Join(root, path))
					if err != nil {
						t.Fatal(err)
					}
					if !decl.has(strings.TrimSuffix(m[2], ".")) {
						t.Errorf("%s:%d names %s:%s, but %s declares no %s", d.path, i+1, m[1], m[2], path, m[2])
					}
				}
			}
		}
	}
}

// isPlanned reports whether name (a path, or a bare name in one of dirs)
// is a file doc has its reader create.
func isPlanned(doc, name string, dirs []string) bool {
	prefix, ok := planned[doc]
	if !ok {
		return false
	}
	if strings.Contains(name, "/") {
		return strings.HasPrefix(name, prefix)
	}
	for _, d := range dirs {
		if strings.HasPrefix(d+"/", prefix) {
			return true
		}
	}
	return false
}

// findFile resolves a file the doc names: a path from the module root (a
// pattern, `pkg/*/example_test.go`, resolves to its first match), or a bare
// name in one of dirs.
func findFile(name string, dirs []string) string {
	if strings.Contains(name, "*") {
		matches, _ := filepath.Glob(filepath.Join(root, name))
		if len(matches) == 0 {
			return ""
		}
		rel, err := filepath.Rel(root, matches[0])
		if err != nil {
			return ""
		}
		return filepath.ToSlash(rel)
	}
	if strings.Contains(name, "/") {
		if _, err := os.Stat(filepath.Join(root, name)); err == nil {
			return name
		}
		return ""
	}
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if _, err := os.Stat(filepath.Join(root, p)); err == nil {
			return p
		}
	}
	return ""
}

// TestLinksResolve checks every relative Markdown link: the file or
// directory exists, and an anchor names a heading of the target as GitHub
// makes it (lower case, spaces to hyphens, punctuation dropped, a repeated
// heading numbered).
func TestLinksResolve(t *testing.T) {
	docs := readDocs(t)
	anchors := map[string]map[string]bool{}
	for _, d := range docs {
		anchors[d.path] = headingAnchors(d)
	}
	for _, d := range docs {
		for i, l := range d.lines {
			if d.fence[i] {
				continue
			}
			l = codeSpan.ReplaceAllString(l, "")
			for _, m := range link.FindAllStringSubmatch(l, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				file, anchor, _ := strings.Cut(target, "#")
				path := d.path
				if file != "" {
					path = filepath.ToSlash(filepath.Join(filepath.Dir(d.path), file))
					if _, err := os.Stat(filepath.Join(root, path)); err != nil {
						t.Errorf("%s:%d links to %s, which does not exist", d.path, i+1, target)
						continue
					}
				}
				if anchor == "" || !strings.HasSuffix(path, ".md") {
					continue
				}
				if !anchors[path][anchor] {
					t.Errorf("%s:%d links to %s, but %s has no heading #%s", d.path, i+1, target, path, anchor)
				}
			}
		}
	}
}

var (
	mdLink    = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
	notInSlug = regexp.MustCompile(`[^\p{L}\p{M}\p{N}\p{Pc} -]`)
)

// headingAnchors are the anchors GitHub gives a document's headings.
func headingAnchors(d document) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for i, l := range d.lines {
		if d.fence[i] || !strings.HasPrefix(l, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(l, "#"))
		text = mdLink.ReplaceAllString(text, "$1")
		text = strings.ReplaceAll(text, "`", "")
		slug := strings.ReplaceAll(notInSlug.ReplaceAllString(strings.ToLower(text), ""), " ", "-")
		if n := seen[slug]; n > 0 {
			out[slug+"-"+strconv.Itoa(n)] = true
		} else {
			out[slug] = true
		}
		seen[slug]++
	}
	return out
}

// TestPackageIdentifiersExist checks every backticked `pkg.Name` and
// `pkg.Type.Member` whose pkg is a package of this module (or a path to
// one, `pkg/outbox.Config`): the package declares Name at top level, and
// Type has Member as a field or a method. A word in lower case alone
// after the dot is as often a span attribute (`saga.from`) or a failpoint
// (`outbox.after_claim`) as an identifier, and is not checked.
func TestPackageIdentifiersExist(t *testing.T) {
	pkgs, err := modulePackages()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range readDocs(t) {
		if d.path == history {
			continue
		}
		for i, l := range d.lines {
			if d.fence[i] {
				continue
			}
			for _, span := range codeSpan.FindAllString(l, -1) {
				m := identRef.FindStringSubmatch(strings.Trim(span, "`"))
				if m == nil || notIdents[m[3]] || isLowerWord(m[3]) && m[4] == "" {
					continue
				}
				var dirs []string
				if m[1] != "" {
					dir := m[1] + m[2]
					if _, ok := pkgs.byDir[dir]; !ok {
						continue
					}
					dirs = []string{dir}
				} else {
					dirs = pkgs.byName[m[2]]
				}
				if len(dirs) == 0 {
					continue
				}
				name := m[3]
				if m[4] != "" {
					name += "." + m[4]
				}
				found := false
				for _, dir := range dirs {
					if pkgs.byDir[dir].has(name) {
						found = true
						break
					}
				}
				if !found {
					t.Errorf("%s:%d names %s, but package %s (%s) declares no %s", d.path, i+1, span, m[2], strings.Join(dirs, ", "), name)
				}
			}
		}
	}
}

// TestTestsExist checks every test, fuzz target and benchmark a document
// names: some _test.go file declares it, and one cited after `dir: ` (in
// the same table cell or paragraph) is declared in that directory.
func TestTestsExist(t *testing.T) {
	tests := declaredTests(t)
	for _, d := range readDocs(t) {
		if d.path == history {
			continue
		}
		for i, l := range d.lines {
			if !d.fence[i] {
				continue
			}
			for _, m := range bareTest.FindAllStringSubmatch(l, -1) {
				if tests[m[1]] == nil {
					t.Errorf("%s:%d names test %s, which no _test.go file declares", d.path, i+1, m[1])
				}
			}
		}
		for _, u := range d.units() {
			dir := ""
			for i := u[0]; i < u[1]; i++ {
				for _, cell := range strings.Split(d.lines[i], "|") {
					if strings.HasPrefix(d.lines[i], "|") {
						dir = ""
					}
					for _, m := range testRef.FindAllStringSubmatch(cell, -1) {
						if m[1] != "" {
							dir = m[1]
						}
						dirs := tests[m[2]]
						switch {
						case dirs == nil:
							t.Errorf("%s:%d names test %s, which no _test.go file declares", d.path, i+1, m[2])
						case dir != "" && !dirs[dir] && isDir(dir):
							t.Errorf("%s:%d names %s in %s, but it is declared in %s", d.path, i+1, m[2], dir, keys(dirs))
						}
					}
				}
			}
		}
	}
}

func isLowerWord(s string) bool { return strings.ToLower(s) == s }

func isDir(p string) bool {
	st, err := os.Stat(filepath.Join(root, p))
	return err == nil && st.IsDir()
}

func keys(m map[string]bool) string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return strings.Join(out, ", ")
}

// declaredTests is every Test, Fuzz and Benchmark function of the module,
// with the directories that declare it.
func declaredTests(t *testing.T) map[string]map[string]bool {
	decl := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz|Benchmark)[A-Za-z0-9_]*)\(`)
	found := map[string]map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && p != root {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, filepath.Dir(p))
		if err != nil {
			return err
		}
		for _, m := range decl.FindAllSubmatch(src, -1) {
			name := string(m[1])
			if found[name] == nil {
				found[name] = map[string]bool{}
			}
			found[name][filepath.ToSlash(rel)] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// Words for documents that are not in the repository. "The contract" is
// defined once, in docs/architecture.md's section of that name.
var absentDocuments = []*regexp.Regexp{
	regexp.MustCompile(`(?i)\bseed texts?\b`),
	regexp.MustCompile(`(?i)\bthe seeds\b`),
	regexp.MustCompile(`(?i)\bcontract\.md\b`),
	regexp.MustCompile(`(?i)\bnot in the contract\b`),
	regexp.MustCompile(`(?i)\bthe (outbox )?article\b`),
	regexp.MustCompile(`(?i)\binterview question\b`),
	regexp.MustCompile(`(?i)\bsource documents?\b`),
}

// TestNoWordsForAbsentDocuments checks no document cites a text the
// repository does not hold, and that "the contract" the documents speak
// of is defined where they can read it.
func TestNoWordsForAbsentDocuments(t *testing.T) {
	docs := readDocs(t)
	usesContract := ""
	defined := false
	for _, d := range docs {
		for i, l := range d.lines {
			for _, re := range absentDocuments {
				if m := re.FindString(l); m != "" {
					t.Errorf("%s:%d says %q: no such document is in the repository", d.path, i+1, m)
				}
			}
			if usesContract == "" && strings.Contains(strings.ToLower(l), "the contract") {
				usesContract = d.path + ":" + strconv.Itoa(i+1)
			}
			if d.path == "docs/architecture.md" && strings.HasPrefix(l, "## The contract") {
				defined = true
			}
		}
	}
	if usesContract != "" && !defined {
		t.Errorf("%s speaks of the contract, but docs/architecture.md has no section \"## The contract\" saying what it is", usesContract)
	}
}

// TestFailureWindowsRowsAreDistinct checks docs/failure-windows.md
// describes each window once: no two rows share their window, nor their
// first place in the code with the tests of one among the other's.
func TestFailureWindowsRowsAreDistinct(t *testing.T) {
	type row struct {
		line  int
		where string
		tests map[string]bool
	}
	for _, d := range readDocs(t) {
		if d.path != "docs/failure-windows.md" {
			continue
		}
		windows := map[string]int{}
		var rows []row
		for i, l := range d.lines {
			cells := strings.Split(strings.Trim(l, "|"), "|")
			header := i+1 < len(d.lines) && strings.HasPrefix(d.lines[i+1], "|---")
			if !strings.HasPrefix(l, "|") || len(cells) < 4 || header || strings.HasPrefix(strings.TrimSpace(cells[0]), "---") {
				continue
			}
			w := strings.Join(strings.Fields(strings.ToLower(cells[0])), " ")
			if j, ok := windows[w]; ok {
				t.Errorf("%s:%d describes the window of line %d again", d.path, i+1, j)
			}
			windows[w] = i + 1
			r := row{line: i + 1, tests: map[string]bool{}}
			if m := fileRef.FindStringSubmatch(cells[1]); m != nil {
				r.where = strings.TrimSuffix(m[1]+":"+m[2], ":")
			}
			for _, m := range testRef.FindAllStringSubmatch(cells[3], -1) {
				r.tests[m[2]] = true
			}
			for _, o := range rows {
				if r.where != "" && r.where == o.where && (subset(r.tests, o.tests) || subset(o.tests, r.tests)) {
					t.Errorf("%s:%d and line %d name the same code (%s) and the same tests: one window, two rows", d.path, o.line, r.line, r.where)
				}
			}
			rows = append(rows, r)
		}
		return
	}
	t.Fatal("docs/failure-windows.md not found")
}

// subset reports whether a, of two tests or more, is within b.
func subset(a, b map[string]bool) bool {
	if len(a) < 2 {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

// history in a row: the git log keeps what was, a row says what is.
var historyWords = regexp.MustCompile(`(?i)\bused to\b|\bbefore (this version|the fix)\b|\bfirst run\b|\(new\b|\bnew:|\bissue \d+\b`)

// TestFailureWindowsCellsAreShort holds each cell of docs/failure-windows.md
// to a sentence and its references, and each row to the present tense.
func TestFailureWindowsCellsAreShort(t *testing.T) {
	const most = 400 // characters
	for _, d := range readDocs(t) {
		if d.path != "docs/failure-windows.md" {
			continue
		}
		for i, l := range d.lines {
			if !strings.HasPrefix(l, "|") {
				continue
			}
			for n, cell := range strings.Split(strings.Trim(l, "|"), "|") {
				if c := len([]rune(strings.TrimSpace(cell))); c > most {
					t.Errorf("%s:%d: cell %d has %d characters (at most %d: a sentence and its references; details belong in docs/architecture.md)", d.path, i+1, n+1, c, most)
				}
			}
			if m := historyWords.FindString(l); m != "" {
				t.Errorf("%s:%d says %q: a row says what is; what was is in the git log", d.path, i+1, m)
			}
		}
		return
	}
	t.Fatal("docs/failure-windows.md not found")
}

// bareIdent is a span naming a declaration alone: `settle`, `Writer.Add`.
var bareIdent = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?$`)

// TestFailureWindowsWhereCellsNameDeclarations reads the "Where in the
// code" cells of docs/failure-windows.md as lists: a bare name after
// `file.go:function` is one more declaration of that file
// (`pkg/outbox/cdc.go:ensureSlot`, `handOver`), so the short form is
// checked as the long one is. Names in capitals are settings, not
// declarations.
func TestFailureWindowsWhereCellsNameDeclarations(t *testing.T) {
	for _, d := range readDocs(t) {
		if d.path != "docs/failure-windows.md" {
			continue
		}
		for i, l := range d.lines {
			cells := strings.Split(strings.Trim(l, "|"), "|")
			if !strings.HasPrefix(l, "|") || len(cells) < 4 {
				continue
			}
			var dirs []string
			for _, m := range fileRef.FindAllStringSubmatch(cells[1], -1) {
				if strings.Contains(m[1], "/") {
					dirs = append(dirs, filepath.Dir(m[1]))
				}
			}
			file := ""
			for _, span := range codeSpan.FindAllString(cells[1], -1) {
				if m := fileRef.FindStringSubmatch(span); m != nil {
					file = findFile(m[1], dirs)
					continue
				}
				name := strings.Trim(span, "`")
				if file == "" || !bareIdent.MatchString(name) || strings.ToUpper(name) == name {
					// an environment variable (`ORDER_MAX_BACKLOG`) is no declaration
					continue
				}
				decl, err := parseFiles(filepath.Join(root, file))
				if err != nil {
					t.Fatal(err)
				}
				if !decl.has(name) {
					t.Errorf("%s:%d names %s after %s, which declares no %s", d.path, i+1, span, file, name)
				}
			}
		}
		return
	}
	t.Fatal("docs/failure-windows.md not found")
}
