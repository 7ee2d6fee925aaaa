// Command staleguard-apiserver is a small Kubernetes API server for
// staleguard's tests, built on k8s.io/apiserver, the generic server library
// kube-apiserver is made of, with an embedded etcd: real resourceVersions,
// watch cache, bookmarks and 410 Gone after compaction. It serves core/v1
// Namespaces, Services and Pods (with pods/status) and discovery.k8s.io/v1
// EndpointSlices on 127.0.0.1 with TLS, anonymous authentication and
// allow-all authorization. See docs/apiserver.md.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apiserver/pkg/authentication/request/anonymous"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	"k8s.io/apiserver/pkg/registry/rest"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/component-base/compatibility"
	"k8s.io/klog/v2"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "staleguard-apiserver: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	started := time.Now()
	dataDir := flag.String("data-dir", "", "where etcd keeps its data (kept across restarts)")
	port := flag.Int("port", 0, "HTTPS port on 127.0.0.1 (0: any free port)")
	certDir := flag.String("cert-dir", "", "where the CA, serving certificate and kubeconfig go (default: <data-dir>/certs)")
	watchCache := flag.Bool("watch-cache", true, "serve lists and watches from the watch cache, as kube-apiserver does")
	compaction := flag.Duration("compaction-interval", 5*time.Minute, "how often the server compacts etcd itself (0: never)")
	verbosity := flag.Int("v", 0, "klog verbosity")
	flag.Parse()
	if *dataDir == "" {
		return fmt.Errorf("--data-dir is required")
	}
	if *certDir == "" {
		*certDir = filepath.Join(*dataDir, "certs")
	}
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", strconv.Itoa(*verbosity))

	ctx := genericapiserver.SetupSignalContext()

	etcd, err := startEtcd(*dataDir)
	if err != nil {
		return err
	}
	defer etcd.Close()

	files, err := ensureCerts(*certDir)
	if err != nil {
		return fmt.Errorf("certificates in %s: %w", *certDir, err)
	}
	listener, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(*port)))
	if err != nil {
		return fmt.Errorf("listen on 127.0.0.1:%d: %w", *port, err)
	}
	actualPort := listener.Addr().(*net.TCPAddr).Port
	serverURL := fmt.Sprintf("https://127.0.0.1:%d", actualPort)

	config := genericapiserver.NewConfig(codecs)
	config.EffectiveVersion = compatibility.NewEffectiveVersionFromString("1.36", "", "")
	config.Authentication.Authenticator = anonymous.NewAuthenticator(nil)
	config.Authorization.Authorizer = authorizerfactory.NewAlwaysAllowAuthorizer()
	config.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(openAPIDefinitions, openapinamer.NewDefinitionNamer(scheme))
	// The models above are only good for managed fields, not for serving.
	config.SkipOpenAPIInstallation = true
	config.ExternalAddress = net.JoinHostPort("127.0.0.1", strconv.Itoa(actualPort))
	config.PublicAddress = net.ParseIP("127.0.0.1")

	counter := newRequestCounter()
	config.BuildHandlerChainFunc = func(h http.Handler, c *genericapiserver.Config) http.Handler {
		return genericapiserver.DefaultBuildHandlerChain(counter.wrap(h), c)
	}

	serving := options.NewSecureServingOptions()
	serving.Listener = listener
	serving.BindAddress = net.ParseIP("127.0.0.1")
	serving.ServerCert.CertKey.CertFile = files.Cert
	serving.ServerCert.CertKey.KeyFile = files.Key
	// The generic server talks to itself through a loopback client (with its
	// own in-memory certificate); it refuses to start without one.
	if err := serving.WithLoopback().ApplyTo(&config.SecureServing, &config.LoopbackClientConfig); err != nil {
		return fmt.Errorf("serving: %w", err)
	}

	storageConfig := storagebackend.NewDefaultConfig("/registry",
		codecs.LegacyCodec(corev1.SchemeGroupVersion, discoveryv1.SchemeGroupVersion))
	storageConfig.Transport.ServerList = []string{etcd.clientURL}
	storageConfig.CompactionInterval = *compaction
	etcdOptions := options.NewEtcdOptions(storageConfig)
	etcdOptions.EnableWatchCache = *watchCache
	if err := etcdOptions.ApplyTo(config); err != nil {
		return fmt.Errorf("storage: %w", err)
	}

	server, err := config.Complete(nil).New("staleguard-apiserver", genericapiserver.NewEmptyDelegate())
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	if err := install(server, config); err != nil {
		return err
	}
	server.Handler.NonGoRestfulMux.HandleFunc("/staleguard/compact", etcd.serveCompact)
	server.Handler.NonGoRestfulMux.HandleFunc("/staleguard/requests", counter.serve)

	if err := writeKubeconfig(files, serverURL); err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	server.AddPostStartHookOrDie("staleguard-ready-log", func(genericapiserver.PostStartHookContext) error {
		fmt.Fprintf(os.Stderr, "staleguard-apiserver: serving %s (kubeconfig %s, etcd %s) started in %d ms\n",
			serverURL, files.Kubeconfig, etcd.clientURL, time.Since(started).Milliseconds())
		return nil
	})
	return server.PrepareRun().RunWithContext(ctx)
}

// install registers the served resources: the legacy core group at /api and
// discovery.k8s.io at /apis.
func install(server *genericapiserver.GenericAPIServer, config *genericapiserver.Config) error {
	opts := config.RESTOptionsGetter
	coreStorage := map[string]rest.Storage{}
	for _, k := range []*kind{namespaceKind, serviceKind} {
		store, err := storageFor(k, opts)
		if err != nil {
			return err
		}
		coreStorage[k.plural] = store
	}
	pods, err := podStorage(opts)
	if err != nil {
		return err
	}
	for path, store := range pods {
		coreStorage[path] = store
	}
	core := genericapiserver.NewDefaultAPIGroupInfo("", scheme, parameterCodec, codecs)
	core.VersionedResourcesStorageMap["v1"] = coreStorage
	if err := server.InstallLegacyAPIGroup(genericapiserver.DefaultLegacyAPIPrefix, &core); err != nil {
		return fmt.Errorf("install core/v1: %w", err)
	}

	slices, err := storageFor(endpointSliceKind, opts)
	if err != nil {
		return err
	}
	discovery := genericapiserver.NewDefaultAPIGroupInfo(discoveryv1.GroupName, scheme, parameterCodec, codecs)
	discovery.VersionedResourcesStorageMap["v1"] = map[string]rest.Storage{"endpointslices": slices}
	if err := server.InstallAPIGroup(&discovery); err != nil {
		return fmt.Errorf("install discovery.k8s.io/v1: %w", err)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
