package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"time"

	"github.com/shop-ref/shop/internal/config"
	"github.com/shop-ref/shop/ops/dashboard"
)

// runsAll reports whether names holds every service of cfg: `shop all`, the
// one process that serves the dashboard and runs the reconciler.
func runsAll(cfg config.Config, names []string) bool {
	for _, n := range cfg.Registry.Names() {
		if !slices.Contains(names, n) {
			return false
		}
	}
	return true
}

// listenDashboard binds cfg.DashboardAddr. The page is a convenience, not a
// service: when its address is taken (8080 often is) it listens on a free
// loopback port instead and says where, rather than stopping the shop.
func listenDashboard(cfg config.Config, log *slog.Logger) (net.Listener, error) {
	ln, err := net.Listen("tcp", cfg.DashboardAddr)
	if err == nil {
		return ln, nil
	}
	log.Warn(cfg.DashboardAddr+" is taken; the dashboard listens on a free port instead "+
		"(set DASHBOARD_ADDR to choose one)", "service", "dashboard", "err", err)
	if ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		return nil, fmt.Errorf("dashboard: listen: %w", err)
	}
	return ln, nil
}

// RunDashboard is `shop dashboard`: the live dashboard alone, on
// cfg.DashboardAddr, for a shop whose services run elsewhere (Compose, one
// process per service). It reads the services' schemas (DATABASE_URL,
// <SERVICE>_DATABASE_URL), places and pays orders through the order and
// payment services' URLs and shows every service's /readyz from its URL
// (config.ServiceConfig.URL: ORDER_URL, …). Unlike `shop all` it does not move to a free port
// when its address is taken: it is the process's only job, and where it
// listens is what the operator asked for.
func RunDashboard(ctx context.Context, cfg config.Config, log *slog.Logger) error {
	urls := map[string]string{}
	for _, name := range cfg.Registry.Names() {
		sc := cfg.Services[name]
		u := sc.URL
		if u == "" {
			_, port, err := net.SplitHostPort(sc.Addr)
			if err != nil {
				return fmt.Errorf("dashboard: the %s service's address %q: %w", name, sc.Addr, err)
			}
			u = "http://127.0.0.1:" + port
		}
		urls[name] = u
	}
	ln, err := net.Listen("tcp", cfg.DashboardAddr)
	if err != nil {
		return fmt.Errorf("dashboard: listen: %w", err)
	}
	log.Info("dashboard calls", "services", urls)
	return runDashboard(ctx, ln, cfg, urls, log)
}

// runDashboard serves the live dashboard on ln until ctx ends. It reads
// every service's schema through a small pool of its own (connected lazily,
// so reads simply fail until the services have migrated) and acts through
// the order and payment services' public APIs, at the base URLs in urls.
func runDashboard(ctx context.Context, ln net.Listener, cfg config.Config, urls map[string]string, log *slog.Logger) error {
	defer ln.Close()
	log = log.With("service", "dashboard")
	shop, closePools, err := OpenShop(ctx, cfg.Schemas(), ShopPoolSize)
	if err != nil {
		return fmt.Errorf("dashboard: %w", err)
	}
	defer closePools()
	pools := make(map[string]dashboard.DB, len(shop.Pools))
	for name, p := range shop.Pools {
		pools[name] = p
	}
	services := map[string]string{} // urls also holds the dashboard's own, which has no /readyz
	for _, name := range cfg.Registry.Names() {
		services[name] = urls[name]
	}
	d, err := dashboard.New(dashboard.Config{
		Services:       cfg.Registry.Names(),
		Pools:          pools,
		OrderURL:       urls["order"],
		PaymentURL:     urls["payment"],
		PaymentTimeout: config.Setting[time.Duration](cfg.Settings, "PAYMENT_TIMEOUT"),
		Demo:           cfg.DashboardDemo,
		CanPay:         config.Setting[bool](cfg.Settings, "PAYMENT_FAKE_PROVIDER"),
		Hosts:          dashboardHosts(cfg),
		ServiceURLs:    services,
		Consumers:      dashboardConsumers(cfg),
		TraceUIURL:     cfg.TraceUIURL,
		Logger:         log,
	})
	if err != nil {
		return err
	}
	go func() { _ = d.Run(ctx) }() // it ends with ctx; a failed sample is logged and retried
	limits := defaultHTTPLimits()
	limits.write = 0 // the page's event stream is open as long as the page: a write deadline would cut it
	srv, err := newHTTPServer(d, limits, log)
	if err != nil {
		return fmt.Errorf("dashboard: %w", err)
	}
	// Requests share ctx, so the page's open event streams end with the
	// process instead of holding Shutdown for its whole timeout.
	srv.BaseContext = func(net.Listener) context.Context { return ctx }
	go func() {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx) // its requests have ended with ctx
	}()
	log.Info("dashboard listening", "url", listenerURL(ln))
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("dashboard: serve http: %w", err)
	}
	return nil
}

// dashboardHosts are the Host names the dashboard answers to besides
// loopback's: DASHBOARD_ADDR's host when it names one (an address bound to
// every interface names none) and DASHBOARD_HOSTS.
func dashboardHosts(cfg config.Config) []string {
	hosts := slices.Clone(cfg.DashboardHosts)
	if h, _, err := net.SplitHostPort(cfg.DashboardAddr); err == nil && h != "" {
		if ip := net.ParseIP(h); ip == nil || !ip.IsUnspecified() {
			hosts = append(hosts, h)
		}
	}
	return hosts
}

// dashboardConsumers lists the registry's consumers with the service that
// runs each and the service whose stream it reads, for the lag chart.
func dashboardConsumers(cfg config.Config) []dashboard.Consumer {
	source := map[string]string{} // stream -> the service that publishes to it
	for _, e := range cfg.Registry {
		source[e.Stream] = e.Name
	}
	var out []dashboard.Consumer
	for _, e := range cfg.Registry {
		for _, c := range e.Consumers {
			if src, ok := source[c.Stream]; ok {
				out = append(out, dashboard.Consumer{Name: c.Name, Service: e.Name, Source: src, Types: c.Types})
			}
		}
	}
	return out
}
