// backend is the test workload of the real-node tests: an HTTP server that names the pod and node
// it runs on, so a test tells which backend answered. A static binary, alone in its image.
//
//	GET /  →  "pod=POD node=NODE\n"   (POD_NAME, NODE_NAME from the downward API; else the hostname)
//
// It listens on :PORT (default 8080) and stops on SIGTERM after finishing the requests in flight.
package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	pod := os.Getenv("POD_NAME")
	if pod == "" {
		pod, _ = os.Hostname()
	}
	node := os.Getenv("NODE_NAME")
	port := os.Getenv("PORT")
	if port == "" {
		port = "8080"
	}
	reply := fmt.Sprintf("pod=%s node=%s\n", pod, node)
	srv := &http.Server{
		Addr:              ":" + port,
		ReadHeaderTimeout: 5 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			_, _ = w.Write([]byte(reply))
		}),
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
