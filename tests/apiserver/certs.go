package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// certFiles are the TLS files the server writes to its cert dir. They are
// kept across restarts so a client keeps trusting a restarted server.
type certFiles struct {
	CA, Cert, Key, Kubeconfig string
}

func certPaths(dir string) certFiles {
	return certFiles{
		CA:         filepath.Join(dir, "ca.crt"),
		Cert:       filepath.Join(dir, "apiserver.crt"),
		Key:        filepath.Join(dir, "apiserver.key"),
		Kubeconfig: filepath.Join(dir, "kubeconfig"),
	}
}

// ensureCerts makes a CA and a serving certificate for 127.0.0.1/localhost
// signed by it, unless they exist. The serving certificate is not a CA itself:
// rustls (kube-rs) refuses a CA certificate used as a server's end entity,
// which is what a single self-signed certificate would be.
func ensureCerts(dir string) (certFiles, error) {
	files := certPaths(dir)
	if fileExists(files.CA) && fileExists(files.Cert) && fileExists(files.Key) {
		return files, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return files, err
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return files, err
	}
	now := time.Now().Add(-time.Hour)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "staleguard-apiserver-ca"},
		NotBefore:             now,
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return files, err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return files, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return files, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "staleguard-apiserver"},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1"), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return files, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return files, err
	}
	for path, block := range map[string]*pem.Block{
		files.CA:   {Type: "CERTIFICATE", Bytes: caDER},
		files.Cert: {Type: "CERTIFICATE", Bytes: der},
		files.Key:  {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			return files, err
		}
	}
	return files, nil
}

// writeKubeconfig writes a kubeconfig for anonymous access to the server.
func writeKubeconfig(files certFiles, server string) error {
	text := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: staleguard
  cluster:
    server: %s
    certificate-authority: %s
contexts:
- name: staleguard
  context:
    cluster: staleguard
    user: anonymous
users:
- name: anonymous
  user: {}
current-context: staleguard
`, server, files.CA)
	tmp := files.Kubeconfig + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, files.Kubeconfig)
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
