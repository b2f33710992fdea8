// testkube runs a real Kubernetes control plane in one process for nodelb's tests: an embedded etcd
// and kube-apiserver (k8s.io/kubernetes, in-process), plus kube-controller-manager's ClusterRole
// aggregation and EndpointSlice controllers. It is a test fixture only; the nodelb agent never
// uses it.
//
//	testkube --data-dir DIR [--bind-address 127.0.0.1] [--secure-port 6443] [--advertise-address IP]
//	         [--control-address 127.0.0.1:0] [--endpointslice-controller=true] [-- APISERVER-FLAG ...]
//
// Everything lives in DIR and is reused by the next start on the same DIR: the CA, serving and
// admin certificates and the ServiceAccount signing key (pki/), etcd's data (etcd/), the chosen
// loopback ports (ports.json), the audit log (audit.log) and the admin kubeconfig
// (admin.kubeconfig). Once /readyz answers ok it writes the kubeconfig and prints one line:
//
//	READY kubeconfig=DIR/admin.kubeconfig server=https://IP:PORT control=http://127.0.0.1:PORT
//
//	testkube user --data-dir DIR --name NAME [--group GROUP]... --out FILE
//
// writes a kubeconfig for the user NAME (a client certificate signed by DIR's CA, for the server
// of DIR's admin kubeconfig): a user the real authenticator knows and the real authorizer judges,
// as a cluster administrator hands out to the cluster's users.
//
// The control address (loopback HTTP) serves POST /compact: compact etcd's history up to its
// current revision, as the API server's own periodic compaction would (answer: {"revision": N}).
// SIGTERM or SIGINT: the API server shuts down gracefully, then etcd; exit status 0.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

type options struct {
	dataDir                 string
	bindAddress             string
	securePort              int
	advertiseAddress        string
	controlAddress          string
	endpointSliceController bool
	apiserverArgs           []string
}

// Service cluster IP ranges: documentation ranges, never used on the wire (no kube-proxy runs).
const serviceCIDRs = "192.0.2.0/24,2001:db8:ffff::/112"

const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
# The API server's own loopback traffic is noise for the tests.
- level: None
  users: ["system:apiserver"]
- level: Metadata
`

func main() {
	if len(os.Args) > 1 && os.Args[1] == "user" {
		if err := user(os.Args[2:]); err != nil {
			fmt.Fprintf(os.Stderr, "testkube user: %v\n", err)
			os.Exit(1)
		}
		return
	}
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "testkube: %v\n", err)
		os.Exit(1)
	}
}

func parseFlags() (options, error) {
	var o options
	fs := flag.NewFlagSet("testkube", flag.ContinueOnError)
	fs.StringVar(&o.dataDir, "data-dir", "", "state directory (certificates, etcd data, kubeconfig, audit log); reused on restart")
	fs.StringVar(&o.bindAddress, "bind-address", "127.0.0.1", "address the API server listens on")
	fs.IntVar(&o.securePort, "secure-port", 6443, "port the API server listens on")
	fs.StringVar(&o.advertiseAddress, "advertise-address", "", "address in the kubeconfig and the kubernetes Service (default: the bind address, or 127.0.0.1 when that is unspecified)")
	fs.StringVar(&o.controlAddress, "control-address", "127.0.0.1:0", "loopback HTTP control endpoint (POST /compact); port 0: chosen once, kept in ports.json")
	fs.BoolVar(&o.endpointSliceController, "endpointslice-controller", true, "run kube-controller-manager's EndpointSlice controller (EndpointSlices from Pods)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return o, err
	}
	o.apiserverArgs = fs.Args()
	if o.dataDir == "" {
		return o, errors.New("--data-dir is required")
	}
	abs, err := filepath.Abs(o.dataDir)
	if err != nil {
		return o, err
	}
	o.dataDir = abs
	if o.advertiseAddress == "" {
		o.advertiseAddress = o.bindAddress
		if ip := net.ParseIP(o.bindAddress); ip == nil || ip.IsUnspecified() {
			o.advertiseAddress = "127.0.0.1"
		}
	}
	if net.ParseIP(o.advertiseAddress) == nil {
		return o, fmt.Errorf("--advertise-address %q is not an IP address", o.advertiseAddress)
	}
	return o, nil
}

// ports are the loopback ports chosen on the first start and reused by every later one: etcd's
// member data records its peer URL, and a test's control client keeps its address across restarts.
type ports struct {
	EtcdClient int `json:"etcdClient"`
	EtcdPeer   int `json:"etcdPeer"`
	Control    int `json:"control"`
}

func loadOrChoosePorts(path, controlAddress string) (ports, error) {
	var p ports
	if data, err := os.ReadFile(path); err == nil {
		if err := json.Unmarshal(data, &p); err != nil {
			return p, fmt.Errorf("%s: %w", path, err)
		}
		return p, nil
	}
	// Each chosen port stays bound until all are chosen: a port closed at once can be handed out
	// again by the next bind, and two components on one port fail to start.
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	free := func() (int, error) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		held = append(held, l)
		return l.Addr().(*net.TCPAddr).Port, nil
	}
	var err error
	if p.EtcdClient, err = free(); err != nil {
		return p, err
	}
	if p.EtcdPeer, err = free(); err != nil {
		return p, err
	}
	_, cport, err := net.SplitHostPort(controlAddress)
	if err != nil {
		return p, fmt.Errorf("--control-address %q: %w", controlAddress, err)
	}
	if p.Control, _ = strconv.Atoi(cport); p.Control == 0 {
		if p.Control, err = free(); err != nil {
			return p, err
		}
	}
	data, _ := json.Marshal(p)
	return p, writeFileAtomic(path, data, 0o600)
}

func run() error {
	o, err := parseFlags()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(o.dataDir, 0o700); err != nil {
		return err
	}
	// Our own context for the controller and the control endpoint; the API server command
	// installs its own SIGTERM/SIGINT handler (genericapiserver.SetupSignalContext).
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	pt, err := loadOrChoosePorts(filepath.Join(o.dataDir, "ports.json"), o.controlAddress)
	if err != nil {
		return err
	}
	keys, err := loadOrCreatePKI(filepath.Join(o.dataDir, "pki"))
	if err != nil {
		return fmt.Errorf("pki: %w", err)
	}
	ips := []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1"), net.ParseIP(o.advertiseAddress),
		net.ParseIP("192.0.2.1"), net.ParseIP("2001:db8:ffff::1")}
	if ip := net.ParseIP(o.bindAddress); ip != nil && !ip.IsUnspecified() {
		ips = append(ips, ip)
	}
	dns := []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
	if err := keys.issueServing(ips, dns); err != nil {
		return fmt.Errorf("serving certificate: %w", err)
	}

	etcd, err := startEtcd(filepath.Join(o.dataDir, "etcd"), pt)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer etcd.Close()

	policy := filepath.Join(o.dataDir, "audit-policy.yaml")
	if err := writeFileAtomic(policy, []byte(auditPolicy), 0o600); err != nil {
		return err
	}
	args := []string{
		"--etcd-servers=" + fmt.Sprintf("http://127.0.0.1:%d", pt.EtcdClient),
		"--bind-address=" + o.bindAddress,
		"--secure-port=" + strconv.Itoa(o.securePort),
		"--advertise-address=" + o.advertiseAddress,
		"--cert-dir=" + keys.dir,
		"--tls-cert-file=" + keys.path("apiserver.crt"),
		"--tls-private-key-file=" + keys.path("apiserver.key"),
		"--client-ca-file=" + keys.path("ca.crt"),
		// How it authenticates to kubelets (logs, exec): the admin certificate, which the
		// kubelets' client CA (this CA) accepts and their webhook authorizer allows.
		"--kubelet-client-certificate=" + keys.path("admin.crt"),
		"--kubelet-client-key=" + keys.path("admin.key"),
		// Nodes are reached at their addresses: no DNS knows their names.
		"--kubelet-preferred-address-types=InternalIP",
		"--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + keys.path("sa.pub"),
		"--service-account-signing-key-file=" + keys.path("sa.key"),
		"--api-audiences=https://kubernetes.default.svc.cluster.local",
		"--service-cluster-ip-range=" + serviceCIDRs,
		"--audit-policy-file=" + policy,
		"--audit-log-path=" + filepath.Join(o.dataDir, "audit.log"),
		"--audit-log-format=json",
		// Written before the response: a test that got an answer finds its request in the log.
		"--audit-log-mode=blocking",
		"--profiling=false",
		// On SIGTERM, stop within seconds although clients hold HTTP/1.1 watches open (kube-rs
		// does): without it, the HTTP server waits up to --request-timeout (60 s) for them.
		"--shutdown-send-retry-after=true",
	}
	if ip := net.ParseIP(o.advertiseAddress); ip.IsLoopback() {
		// The kubernetes Service's endpoints may not be loopback addresses: do not publish them.
		args = append(args, "--endpoint-reconciler-type=none")
	}
	// Passed last: a repeated flag overrides ours (pflag keeps the last value).
	args = append(args, o.apiserverArgs...)
	apiDone := startAPIServer(args)

	server := fmt.Sprintf("https://%s", net.JoinHostPort(o.advertiseAddress, strconv.Itoa(o.securePort)))
	kubeconfig := filepath.Join(o.dataDir, "admin.kubeconfig")
	if err := waitReady(ctx, server, keys, apiDone); err != nil {
		return err
	}
	if err := writeKubeconfig(kubeconfig, server, keys); err != nil {
		return err
	}
	control, err := serveControl(ctx, fmt.Sprintf("127.0.0.1:%d", pt.Control), etcd)
	if err != nil {
		return fmt.Errorf("control endpoint: %w", err)
	}
	if err := startControllers(ctx, kubeconfig, o.endpointSliceController); err != nil {
		return fmt.Errorf("controllers: %w", err)
	}
	fmt.Printf("READY kubeconfig=%s server=%s control=http://%s\n", kubeconfig, server, control)

	if err := <-apiDone; err != nil {
		return fmt.Errorf("kube-apiserver: %w", err)
	}
	fmt.Fprintln(os.Stderr, "testkube: kube-apiserver stopped; stopping etcd")
	return nil
}

// waitReady polls /readyz with the admin certificate until it answers 200 ok.
func waitReady(ctx context.Context, server string, keys *pki, apiDone <-chan error) error {
	client, err := adminHTTPClient(keys)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Minute)
	var last string
	for time.Now().Before(deadline) {
		select {
		case err := <-apiDone:
			return fmt.Errorf("kube-apiserver exited before it was ready: %v", err)
		case <-ctx.Done():
			return errors.New("stopped before the API server was ready")
		case <-time.After(200 * time.Millisecond):
		}
		resp, err := client.Get(server + "/readyz")
		if err != nil {
			last = err.Error()
			continue
		}
		body := make([]byte, 4096)
		n, _ := resp.Body.Read(body)
		resp.Body.Close()
		last = fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(body[:n])))
		if resp.StatusCode == http.StatusOK {
			return nil
		}
	}
	return fmt.Errorf("kube-apiserver not ready within 5 minutes; last /readyz: %s", last)
}

func adminHTTPClient(keys *pki) (*http.Client, error) {
	cert, err := tls.LoadX509KeyPair(keys.path("admin.crt"), keys.path("admin.key"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(keys.caCert)
	return &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}},
	}, nil
}

type groupList []string

func (g *groupList) String() string     { return strings.Join(*g, ",") }
func (g *groupList) Set(v string) error { *g = append(*g, v); return nil }

// user writes a kubeconfig for a user of the control plane in --data-dir (see the package
// documentation).
func user(args []string) error {
	fs := flag.NewFlagSet("testkube user", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "the control plane's state directory")
	name := fs.String("name", "", "user name (the certificate's CommonName)")
	out := fs.String("out", "", "kubeconfig to write")
	var groups groupList
	fs.Var(&groups, "group", "a group of the user (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dataDir == "" || *name == "" || *out == "" {
		return errors.New("--data-dir, --name and --out are required")
	}
	keys, err := loadOrCreatePKI(filepath.Join(*dataDir, "pki"))
	if err != nil {
		return err
	}
	if err := keys.issueUser(*name, groups); err != nil {
		return err
	}
	admin, err := os.ReadFile(filepath.Join(*dataDir, "admin.kubeconfig"))
	if err != nil {
		return fmt.Errorf("the control plane has not written its kubeconfig yet: %w", err)
	}
	server := ""
	for _, line := range strings.Split(string(admin), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "server: "); ok {
			server = v
		}
	}
	if server == "" {
		return errors.New("no server in the admin kubeconfig")
	}
	return writeUserKubeconfig(*out, server, keys, "user-"+*name, *name)
}

func writeKubeconfig(path, server string, keys *pki) error {
	return writeUserKubeconfig(path, server, keys, "admin", "admin")
}

// writeUserKubeconfig writes a kubeconfig with the client certificate <cert>.crt/.key of the
// PKI, naming the user `user`.
func writeUserKubeconfig(path, server string, keys *pki, cert, user string) error {
	b64 := func(name string) (string, error) {
		data, err := os.ReadFile(keys.path(name))
		return base64.StdEncoding.EncodeToString(data), err
	}
	ca, err := b64("ca.crt")
	if err != nil {
		return err
	}
	crt, err := b64(cert + ".crt")
	if err != nil {
		return err
	}
	key, err := b64(cert + ".key")
	if err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: testkube
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: %s
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: testkube
  context:
    cluster: testkube
    user: %s
current-context: testkube
`, server, ca, user, crt, key, user)
	return writeFileAtomic(path, []byte(cfg), 0o600)
}
