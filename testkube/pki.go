package main

// The control plane's keys and certificates, kept in <data-dir>/pki so that a restart on the same
// data dir keeps them (clients' kubeconfigs and ServiceAccount tokens stay valid).

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

type pki struct {
	dir    string
	caCert *x509.Certificate
	caKey  crypto.Signer
}

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

// loadOrCreatePKI makes the CA, the admin client certificate (O=system:masters) and the
// ServiceAccount signing key on the first start; later starts load them.
func loadOrCreatePKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &pki{dir: dir}
	if _, err := os.Stat(p.path("ca.crt")); errors.Is(err, os.ErrNotExist) {
		key, err := newKey()
		if err != nil {
			return nil, err
		}
		tmpl := &x509.Certificate{
			Subject:               pkix.Name{CommonName: "testkube-ca"},
			KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
			BasicConstraintsValid: true,
			IsCA:                  true,
		}
		cert, err := sign(tmpl, key.Public(), tmpl, key)
		if err != nil {
			return nil, err
		}
		if err := writeCertKey(p.path("ca"), cert, key); err != nil {
			return nil, err
		}
	}
	var err error
	if p.caCert, p.caKey, err = readCertKey(p.path("ca")); err != nil {
		return nil, err
	}
	if _, err := os.Stat(p.path("admin.crt")); errors.Is(err, os.ErrNotExist) {
		err := p.issue("admin", &x509.Certificate{
			Subject:     pkix.Name{CommonName: "testkube-admin", Organization: []string{"system:masters"}},
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		})
		if err != nil {
			return nil, err
		}
	}
	if _, err := os.Stat(p.path("sa.key")); errors.Is(err, os.ErrNotExist) {
		key, err := newKey()
		if err != nil {
			return nil, err
		}
		der, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return nil, err
		}
		pub, err := x509.MarshalPKIXPublicKey(key.Public())
		if err != nil {
			return nil, err
		}
		if err := writePEM(p.path("sa.key"), "PRIVATE KEY", der); err != nil {
			return nil, err
		}
		if err := writePEM(p.path("sa.pub"), "PUBLIC KEY", pub); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// issueServing (re)issues the API server's serving certificate for these addresses on every start
// (the bind address may differ from the last run; the CA stays, so clients keep trusting it).
func (p *pki) issueServing(ips []net.IP, dns []string) error {
	return p.issue("apiserver", &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: ips,
		DNSNames:    dns,
	})
}

func (p *pki) issue(name string, tmpl *x509.Certificate) error {
	key, err := newKey()
	if err != nil {
		return err
	}
	cert, err := sign(tmpl, key.Public(), p.caCert, p.caKey)
	if err != nil {
		return err
	}
	return writeCertKey(p.path(name), cert, key)
}

// issueUser issues a client certificate for user `name` (groups: `groups`, besides
// system:authenticated, which the API server adds), signed by the CA: what a cluster's users get
// from their administrator. The files are <dir>/user-<name>.crt and .key.
func (p *pki) issueUser(name string, groups []string) error {
	return p.issue("user-"+name, &x509.Certificate{
		Subject:     pkix.Name{CommonName: name, Organization: groups},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
}

func newKey() (*ecdsa.PrivateKey, error) { return ecdsa.GenerateKey(elliptic.P256(), rand.Reader) }

func sign(tmpl *x509.Certificate, pub crypto.PublicKey, parent *x509.Certificate, key crypto.Signer) (*x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(10 * 365 * 24 * time.Hour)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, key)
	if err != nil {
		return nil, err
	}
	return x509.ParseCertificate(der)
}

func writeCertKey(base string, cert *x509.Certificate, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := writePEM(base+".key", "EC PRIVATE KEY", der); err != nil {
		return err
	}
	return writePEM(base+".crt", "CERTIFICATE", cert.Raw)
}

func readCertKey(base string) (*x509.Certificate, crypto.Signer, error) {
	certPEM, err := os.ReadFile(base + ".crt")
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err := os.ReadFile(base + ".key")
	if err != nil {
		return nil, nil, err
	}
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, nil, fmt.Errorf("%s.crt/.key: no PEM block", base)
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, err
	}
	return cert, key, nil
}

func writePEM(path, typ string, der []byte) error {
	return writeFileAtomic(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// writeFileAtomic writes a temporary file next to path and renames it over path, so a reader
// (a test waiting for the kubeconfig) never sees half a file.
func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
