package main

import (
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	openapicommon "k8s.io/kube-openapi/pkg/common"
	openapiutil "k8s.io/kube-openapi/pkg/util"
	"k8s.io/kube-openapi/pkg/validation/spec"
)

// The real kube-apiserver stores internal types and converts at the edge; the
// internal types live in k8s.io/kubernetes, which Debian does not package. This
// server registers the versioned types as their own internal version, so the
// scheme "converts" by copying and everything else (storage, watch cache,
// codecs) is the unmodified generic machinery.
var (
	scheme         = runtime.NewScheme()
	codecs         = serializer.NewCodecFactory(scheme)
	parameterCodec = runtime.NewParameterCodec(scheme)
)

func init() {
	metav1.AddToGroupVersion(scheme, schema.GroupVersion{Version: "v1"})
	scheme.AddUnversionedTypes(schema.GroupVersion{Group: "", Version: "v1"},
		&metav1.Status{}, &metav1.APIVersions{}, &metav1.APIGroupList{},
		&metav1.APIGroup{}, &metav1.APIResourceList{})

	core := []runtime.Object{
		&corev1.Namespace{}, &corev1.NamespaceList{},
		&corev1.Service{}, &corev1.ServiceList{},
		&corev1.Pod{}, &corev1.PodList{},
	}
	discovery := []runtime.Object{&discoveryv1.EndpointSlice{}, &discoveryv1.EndpointSliceList{}}
	for _, gv := range []schema.GroupVersion{corev1.SchemeGroupVersion, {Group: "", Version: runtime.APIVersionInternal}} {
		scheme.AddKnownTypes(gv, core...)
	}
	for _, gv := range []schema.GroupVersion{discoveryv1.SchemeGroupVersion, {Group: discoveryv1.GroupName, Version: runtime.APIVersionInternal}} {
		scheme.AddKnownTypes(gv, discovery...)
	}
	metav1.AddToGroupVersion(scheme, corev1.SchemeGroupVersion)
	metav1.AddToGroupVersion(scheme, discoveryv1.SchemeGroupVersion)

	// Field selectors a client may send (clients such as kubectl and kube-rs
	// use metadata.name for single-object watches).
	must(scheme.AddFieldLabelConversionFunc(corev1.SchemeGroupVersion.WithKind("Pod"),
		allowFields("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase", "status.podIP")))
	for _, kind := range []string{"Service", "Namespace"} {
		must(scheme.AddFieldLabelConversionFunc(corev1.SchemeGroupVersion.WithKind(kind),
			allowFields("metadata.name", "metadata.namespace")))
	}
	must(scheme.AddFieldLabelConversionFunc(discoveryv1.SchemeGroupVersion.WithKind("EndpointSlice"),
		allowFields("metadata.name", "metadata.namespace", "addressType")))
}

func allowFields(names ...string) runtime.FieldLabelConversionFunc {
	return func(label, value string) (string, string, error) {
		for _, n := range names {
			if n == label {
				return label, value, nil
			}
		}
		return "", "", fieldError(label)
	}
}

type fieldError string

func (f fieldError) Error() string { return "field label not supported: " + string(f) }

func must(err error) {
	if err != nil {
		panic(err)
	}
}

// openAPIDefinitions gives each served kind an object schema that keeps
// unknown fields. The generic server needs OpenAPI models only to build the
// type converter behind managed fields (server-side apply); the generated
// definitions for the built-in types live in k8s.io/kubernetes, not packaged.
// With this, managed fields are tracked on a deduced schema (lists atomic).
func openAPIDefinitions(_ openapicommon.ReferenceCallback) map[string]openapicommon.OpenAPIDefinition {
	defs := map[string]openapicommon.OpenAPIDefinition{}
	for _, obj := range []runtime.Object{
		&corev1.Namespace{}, &corev1.Service{}, &corev1.Pod{}, &discoveryv1.EndpointSlice{},
	} {
		name := openapiutil.GetCanonicalTypeName(obj)
		s := spec.Schema{}
		s.Type = []string{"object"}
		s.Extensions = spec.Extensions{"x-kubernetes-preserve-unknown-fields": true}
		defs[name] = openapicommon.OpenAPIDefinition{Schema: s}
	}
	return defs
}
