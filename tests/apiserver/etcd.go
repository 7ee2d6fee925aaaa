package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/embed"
)

// embeddedEtcd is the single-member etcd the server stores into.
type embeddedEtcd struct {
	etcd      *embed.Etcd
	clientURL string
}

// etcdPorts are kept in the data dir: a restarted server must find its etcd
// member at the peer address it was created with.
type etcdPorts struct {
	Client int `json:"client"`
	Peer   int `json:"peer"`
}

func startEtcd(dataDir string) (*embeddedEtcd, error) {
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, err
	}
	portsFile := filepath.Join(dataDir, "etcd-ports.json")
	var ports etcdPorts
	if text, err := os.ReadFile(portsFile); err == nil {
		if err := json.Unmarshal(text, &ports); err != nil {
			return nil, fmt.Errorf("%s: %w", portsFile, err)
		}
	} else {
		var err error
		if ports.Client, err = freePort(); err != nil {
			return nil, err
		}
		if ports.Peer, err = freePort(); err != nil {
			return nil, err
		}
		text, _ := json.Marshal(ports)
		if err := os.WriteFile(portsFile, text, 0o600); err != nil {
			return nil, err
		}
	}
	clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports.Client)}
	peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports.Peer)}

	cfg := embed.NewConfig()
	cfg.Name = "staleguard"
	cfg.Dir = filepath.Join(dataDir, "etcd")
	cfg.ListenClientUrls = []url.URL{clientURL}
	cfg.AdvertiseClientUrls = []url.URL{clientURL}
	cfg.ListenPeerUrls = []url.URL{peerURL}
	cfg.AdvertisePeerUrls = []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "error"
	// Tests want speed, not durability across power loss.
	cfg.UnsafeNoFsync = true
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("start etcd in %s: %w", cfg.Dir, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, fmt.Errorf("etcd not ready after 60s")
	}
	return &embeddedEtcd{etcd: e, clientURL: clientURL.String()}, nil
}

func (e *embeddedEtcd) Close() { e.etcd.Close() }

// serveCompact compacts etcd up to its current revision (POST), so that a
// watch from an older resourceVersion that reaches etcd gets 410 Gone.
func (e *embeddedEtcd) serveCompact(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST to compact", http.StatusMethodNotAllowed)
		return
	}
	rev := e.etcd.Server.KV().Rev()
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	if _, err := e.etcd.Server.Compact(ctx, &pb.CompactionRequest{Revision: rev, Physical: true}); err != nil {
		http.Error(w, "compact: "+err.Error(), http.StatusInternalServerError)
		return
	}
	writeJSON(w, map[string]int64{"revision": rev})
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
