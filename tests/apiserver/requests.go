package main

import (
	"net/http"
	"sort"
	"sync"

	"k8s.io/apiserver/pkg/endpoints/request"
)

// requestCounter counts every API request by user agent, verb and resource,
// so a benchmark can prove which calls a client made (list and watch only).
type requestCounter struct {
	mu     sync.Mutex
	counts map[requestKey]int64
}

type requestKey struct {
	UserAgent string `json:"userAgent"`
	Verb      string `json:"verb"`
	Resource  string `json:"resource"`
}

type requestCount struct {
	requestKey
	Count int64 `json:"count"`
}

func newRequestCounter() *requestCounter {
	return &requestCounter{counts: map[requestKey]int64{}}
}

// wrap counts a request once the handler chain has resolved what it is.
func (c *requestCounter) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := requestKey{UserAgent: r.UserAgent(), Verb: r.Method, Resource: r.URL.Path}
		if info, ok := request.RequestInfoFrom(r.Context()); ok && info.IsResourceRequest {
			key.Verb = info.Verb
			key.Resource = info.Resource
			if info.Subresource != "" {
				key.Resource += "/" + info.Subresource
			}
		}
		c.mu.Lock()
		c.counts[key]++
		c.mu.Unlock()
		next.ServeHTTP(w, r)
	})
}

// serve answers GET /staleguard/requests with the counts so far (DELETE
// clears them).
func (c *requestCounter) serve(w http.ResponseWriter, r *http.Request) {
	c.mu.Lock()
	out := make([]requestCount, 0, len(c.counts))
	for k, n := range c.counts {
		out = append(out, requestCount{k, n})
	}
	if r.Method == http.MethodDelete {
		c.counts = map[requestKey]int64{}
	}
	c.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i].requestKey, out[j].requestKey
		if a.UserAgent != b.UserAgent {
			return a.UserAgent < b.UserAgent
		}
		if a.Resource != b.Resource {
			return a.Resource < b.Resource
		}
		return a.Verb < b.Verb
	})
	writeJSON(w, out)
}
