package main

// The components testkube runs in-process: etcd, kube-apiserver, kube-controller-manager's
// ClusterRole aggregation and EndpointSlice controllers, and the loopback control endpoint.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3client"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/pkg/controller/clusterroleaggregation"
	"k8s.io/kubernetes/pkg/controller/endpointslice"
)

// startEtcd starts a single-member etcd with its data in dir, on loopback only.
func startEtcd(dir string, pt ports) (*embed.Etcd, error) {
	cfg := embed.NewConfig()
	cfg.Name = "testkube"
	cfg.Dir = dir
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", pt.EtcdClient)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", pt.EtcdPeer)}
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	// A test fixture: a crash may lose the last writes, and tests never rely on surviving one.
	cfg.UnsafeNoFsync = true
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, err
	case <-time.After(time.Minute):
		e.Close()
		return nil, fmt.Errorf("not ready within a minute")
	}
}

// startAPIServer runs kube-apiserver's own command (flags parsed and validated as the binary
// does) on a goroutine; the channel gets its result when it stops (after SIGTERM: nil).
func startAPIServer(args []string) <-chan error {
	done := make(chan error, 1)
	cmd := app.NewAPIServerCommand()
	cmd.SetArgs(args)
	go func() { done <- cmd.Execute() }()
	return done
}

// startControllers runs kube-controller-manager's controllers the tests need, with the admin
// credentials: the ClusterRole aggregation controller (the built-in `admin`, `edit` and `view`
// roles are aggregated: empty without it), and, when endpointSlices, the EndpointSlice controller
// (EndpointSlices for Services with a selector, from Pods whose status a test sets as a kubelet
// would).
func startControllers(ctx context.Context, kubeconfig string, endpointSlices bool) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	cfg.UserAgent = "testkube/kube-controller-manager"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	f := informers.NewSharedInformerFactory(cs, 0)
	aggregation := clusterroleaggregation.NewClusterRoleAggregation(f.Rbac().V1().ClusterRoles(), cs.RbacV1())
	go aggregation.Run(ctx, 1)
	if endpointSlices {
		c := endpointslice.NewController(ctx,
			f.Core().V1().Pods(), f.Core().V1().Services(), f.Core().V1().Nodes(),
			f.Discovery().V1().EndpointSlices(),
			100, // kube-controller-manager's default --max-endpoints-per-slice
			cs, 0)
		go c.Run(ctx, 2)
	}
	f.Start(ctx.Done())
	return nil
}

// serveControl serves the control endpoint on addr (loopback); returns the address it listens on.
func serveControl(ctx context.Context, addr string, e *embed.Etcd) (string, error) {
	kv := v3client.New(e.Server)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /compact", func(w http.ResponseWriter, r *http.Request) {
		// Any read returns the store's current revision in its header.
		resp, err := kv.Get(r.Context(), "compact-probe")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		rev := resp.Header.Revision
		if _, err := kv.Compact(r.Context(), rev, clientv3.WithCompactPhysical()); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]int64{"revision": rev})
	})
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(l) }()
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	return l.Addr().String(), nil
}
